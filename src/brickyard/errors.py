"""The one exception type a user can cause; the CLI prints it as one line and exits non-zero."""


class BrickyardError(Exception):
    """A user-facing error: the message is one clear sentence, shown without a traceback."""

    exit_code = 2


class ConfigError(BrickyardError):
    """A configuration key, type or value that is not allowed."""


class DataError(BrickyardError):
    """Missing, truncated or corrupt data files."""


class CheckpointError(BrickyardError):
    """A checkpoint that cannot be read or does not fit the model."""


class DeviceError(BrickyardError):
    """A device that does not exist or cannot do what the config asks."""
