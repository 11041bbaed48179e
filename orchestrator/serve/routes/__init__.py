"""The front end's routes, one router per group of the Tinker API."""
