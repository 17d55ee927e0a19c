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


def is_panic(exc: BaseException) -> bool:
    """A Rust panic inside a native library (tokenizers, llguidance): pyo3 raises it as its own
    PanicException, a BaseException, so `except Exception` lets it through. Each pyo3 module
    makes its own class of that name, so the name is what tells it."""
    return type(exc).__name__ == "PanicException"


def is_failure(exc: BaseException) -> bool:
    """An error that belongs to the work that raised it (an Exception, or a native panic), as
    against an interrupt, an exit or a cancellation, which must propagate."""
    return isinstance(exc, Exception) or is_panic(exc)
