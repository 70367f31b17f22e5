"""Errors meant for people: each message is one line naming the file, tensor, field or flag."""


class TprtError(Exception):
    """Base class; the command-line tools print the message alone and exit non-zero."""


class ConfigError(TprtError):
    """A config.json field, a flag or their combination is not acceptable."""


class CheckpointError(TprtError):
    """A checkpoint file, tensor or manifest is missing, malformed or inconsistent."""


class OutputError(CheckpointError):
    """Writing the output failed (disk full, permissions): not the input's fault."""


class ValidationError(ConfigError):
    """A request or sampling field is out of range; `field` names it (e.g. "top_p") for flags and gRPC."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
