"""The one error of user input to the config system; the CLI prints it as one line and exits with 2."""


class ConfigError(ValueError):
    """A mistake in a preset file or an override; the message is meant for the user as is."""
