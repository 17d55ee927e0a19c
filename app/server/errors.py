"""Every error on the wire in OpenAI's shape: {"error": {message, type, param, code}}."""

import json

from pydantic import BaseModel, ValidationError
from quart import Response

from app.server.schemas import ErrorInfo, ErrorResponse

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=TYPES.get(self.status, "error"), param=self.param,
                         code=self.code if self.code is not None else self.status)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> Response:
        response = Response(json.dumps(self.body()), status=self.status, content_type="application/json")
        response.headers.update(self.headers)
        return response


def validate(model: type[BaseModel], data):
    """A request body (already decoded JSON) as a pydantic model, or a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=where or None) from None
