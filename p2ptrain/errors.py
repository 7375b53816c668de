"""Errors that are the user's to fix: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """A mistake in flags, config, files or environment, explained in one line that says how to fix it."""


class ConfigError(UserError):
    """A config file or flag holds an unknown key or a value out of range."""


class CheckpointError(UserError):
    """A checkpoint is corrupt, truncated, or does not fit the configured model."""


class StateMismatchError(Exception):
    """Tensors received from a peer do not fit ours (names, shapes, dtypes, non-finite values)."""


def one_line(error: BaseException, max_chars: int = 300) -> str:
    """An exception's message folded onto one line (or its type name), shortened: for one-line user errors."""
    message = " ".join(str(error).split()) or type(error).__name__
    return message if len(message) <= max_chars else message[: max_chars - 3] + "..."
