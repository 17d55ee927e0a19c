"""Every error on the wire in OpenAI's shape: {"error": {message, type, param, code}}; an API
with a shape of its own (Anthropic's, app/server/anthropic/schemas.py) gives its body instead."""

import json

from pydantic import BaseModel, ValidationError
from quart import Response


TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's shape: code is a string that names the error, or null (never the status)."""
        info = ErrorInfo(message=self.message, type=TYPES.get(self.status, "error"), param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, body: dict | None = None) -> Response:
        """The error as an HTTP response: its body in OpenAI's shape, unless given another."""
        response = Response(json.dumps(body or self.body()), status=self.status, content_type="application/json")
        response.headers.update(self.headers)
        return response


def decode_json(raw, what: str = "the body"):
    """JSON text as Python data, or a 400: malformed, or nested deeper than the parser can go
    (json raises RecursionError there, which must not become a 500)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError(400, f"{what} nests too deeply to parse") from None
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{what} is not valid JSON: {e}") from None


def validate(model: type[BaseModel], data):
    """A request body (already decoded JSON) as a pydantic model, or a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        first = next((err for err in errors if err["type"] == "unsupported"), errors[0])  # the clearest one
        # pydantic's own steps in a location ("list[...]", "function-after[...]") mean nothing to a client
        where = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p == "str")))
        if first["type"] == "unsupported" and not where:  # a whole-body check names its field itself
            where = (first.get("ctx") or {}).get("field", "")
            raise APIError(400, first["msg"], param=where or None) from None
        raise APIError(400, f"{where}: {first['msg']}", param=where or None) from None
