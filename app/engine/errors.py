"""The requests the engine refuses, each with a message fit for an API client.
The server maps each class to its HTTP status (400, 429, 503)."""


class EngineError(ValueError):
    """A request the engine refuses; param names the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Overloaded(EngineError):
    """The waiting queue is full; try again later (HTTP 429)."""


class Draining(EngineError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class RequestFault(str):
    """A request's end in error that the request caused, not the engine (HTTP 400): its own
    constraints left no token to sample. A str, so it rides every frame a message does."""
