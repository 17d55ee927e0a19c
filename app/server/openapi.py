"""GET /openapi.json, generated from the pydantic request and response models that each API's
routes document (their DOCUMENTED tables, gathered by app/server/app.py)."""

import re
from dataclasses import dataclass
from functools import cache

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import version
from app.server.errors import ErrorResponse


@dataclass(frozen=True)
class Documented:
    """One route as the spec shows it."""

    path: str  # with {name} for each part the path takes
    method: str
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream: str | None = None  # with stream=true: what each event's data holds
    error: type[BaseModel] = ErrorResponse  # the body of its errors
    shape: str = "OpenAI"  # whose shape that is
    also: tuple[type[BaseModel], ...] = ()  # models it sends besides (a stream's chunk)


@cache
def _components(documented: tuple[Documented, ...]) -> tuple[dict, dict]:
    models = {model for route in documented
              for model in (route.request, route.response, route.error, *route.also) if model}
    keys, top = models_json_schema([(model, "validation") for model in sorted(models, key=lambda x: x.__name__)],
                                   ref_template="#/components/schemas/{model}")
    return {model: ref for (model, _), ref in keys.items()}, top.get("$defs", {})


def spec(model_name: str, documented: tuple[Documented, ...]) -> dict:
    refs, schemas = _components(documented)
    paths: dict = {}
    for route in documented:
        error = {"content": {"application/json": {"schema": refs[route.error]}},
                 "description": f"{route.shape}-shaped error"}
        op: dict = {"summary": route.summary, "responses": {"200": {"description": "OK"}}}
        names = re.findall(r"{(\w+)}", route.path)
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
        if route.response is not None:
            op["responses"]["200"]["content"] = {"application/json": {"schema": refs[route.response]}}
        if route.stream is not None:
            op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {  # one server-sent event
                "type": "object", "required": ["data"], "properties": {"data": {
                    "type": "string", "description": route.stream}}}}
        if route.request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[route.request]}}}
            op["responses"]["400"] = error
        op["responses"]["default"] = error
        paths.setdefault(route.path, {})[route.method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Spool", "version": version(), "description": f"OpenAI-compatible server for {model_name}"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
