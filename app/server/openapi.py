"""GET /openapi.json, generated from the pydantic request and response models."""

import re
from functools import cache

from pydantic.json_schema import models_json_schema

from app import version
from app.server import messages_schemas as m
from app.server import responses_schemas as r
from app.server import schemas as s

ROUTES = [
    # path, method, summary, request model, response model
    ("/v1/chat/completions", "post", "Chat completion (JSON, or SSE chunks with stream=true)",
     s.ChatCompletionRequest, s.ChatCompletionResponse),
    ("/v1/completions", "post", "Text completion (JSON, or SSE chunks with stream=true)",
     s.CompletionRequest, s.CompletionResponse),
    ("/v1/embeddings", "post", "Each input's last hidden state as a unit vector (float or base64)",
     s.EmbeddingRequest, s.EmbeddingResponse),
    ("/v1/messages", "post", "Anthropic's Messages API (JSON, or typed SSE events with stream=true)",
     m.MessagesRequest, m.MessageResponse),
    ("/v1/messages/count_tokens", "post", "The prompt length of a Messages request, tools included",
     m.CountTokensRequest, m.CountTokensResponse),
    ("/v1/responses", "post", "OpenAI's Responses API (JSON, or typed SSE events with stream=true)",
     r.ResponsesRequest, r.ResponseObject),
    ("/v1/responses/{response_id}", "get", "A stored response", None, r.ResponseObject),
    ("/v1/responses/{response_id}", "delete", "Forget a stored response", None, r.DeletedResponse),
    ("/v1/models", "get", "The served model", None, s.ModelList),
    ("/v1/models/{model_id}", "get", "The served model's card; 404 for any other id", None, s.ModelCard),
    ("/tokenize", "post", "Text or chat messages to token ids", s.TokenizeRequest, None),
    ("/detokenize", "post", "Token ids to text", s.DetokenizeRequest, None),
    ("/health", "get", "200 when serving; 503 while loading or draining", None, None),
    ("/metrics", "get", "Prometheus metrics (spool: prefix, vLLM's names)", None, None),
]
# Routes that answer an event stream when asked (stream=true), and what each event's data holds.
STREAM_CHUNKS = {"/v1/chat/completions": "a ChatCompletionChunk as JSON, or [DONE] last",
                 "/v1/completions": "a CompletionResponse as JSON, or [DONE] last",
                 "/v1/messages": "one of Anthropic's typed events as JSON, named on its event: line",
                 "/v1/responses": "one of the Responses API's typed events as JSON, named on its event: line"}
# Routes whose errors come in Anthropic's shape.
ANTHROPIC = {"/v1/messages", "/v1/messages/count_tokens"}


@cache
def _components() -> tuple[dict, dict]:
    models = ({model for _, _, _, req, resp in ROUTES for model in (req, resp) if model}
              | {s.ErrorResponse, s.ChatCompletionChunk, m.AnthropicErrorResponse})
    keys, top = models_json_schema([(model, "validation") for model in sorted(models, key=lambda x: x.__name__)],
                                   ref_template="#/components/schemas/{model}")
    return {model: ref for (model, _), ref in keys.items()}, top.get("$defs", {})


def spec(model_name: str) -> dict:
    refs, schemas = _components()
    paths: dict = {}
    for path, method, summary, req, resp in ROUTES:
        shape = "Anthropic" if path in ANTHROPIC else "OpenAI"
        error = {"content": {"application/json": {"schema": refs[m.AnthropicErrorResponse if path in ANTHROPIC
                                                                else s.ErrorResponse]}},
                 "description": f"{shape}-shaped error"}
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        names = re.findall(r"{(\w+)}", path)
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
        if resp is not None:
            op["responses"]["200"]["content"] = {"application/json": {"schema": refs[resp]}}
        if path in STREAM_CHUNKS:
            op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {  # one server-sent event
                "type": "object", "required": ["data"], "properties": {"data": {
                    "type": "string", "description": STREAM_CHUNKS[path]}}}}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[req]}}}
            op["responses"]["400"] = error
        op["responses"]["default"] = error
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Spool", "version": version(), "description": f"OpenAI-compatible server for {model_name}"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
