"""User-facing errors: the CLI prints their message (no traceback) and exits with code 2."""


class HetrainError(Exception):
    """Base class for errors a user can fix (bad config, missing file, port in use)."""


class ConfigError(HetrainError, ValueError):
    """A config or cluster file is wrong; the message names the key and the allowed values."""


class ReportedElsewhereError(HetrainError):
    """A user error that another process of the same node has already printed (every rank of
    a node that nobody joined times out alike): exit 2 without printing it again."""
