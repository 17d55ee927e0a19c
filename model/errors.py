"""The one exception model/ raises for problems a user can fix.

Its message is a single line that names the problem and the fix; the CLI prints it as is,
without a traceback.
"""


class ModelError(Exception):
    """A model that cannot be found, read, converted or run, said in one line."""


def one_line(exc: BaseException | str) -> str:
    """An exception's text with its line breaks folded, for use inside a ModelError message."""
    text = " ".join(str(exc).split())
    if not text and isinstance(exc, BaseException):
        return type(exc).__name__
    return text
