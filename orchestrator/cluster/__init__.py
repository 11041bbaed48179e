"""The driver, host actors, reservation and worker processes of a run on Ray."""
