"""GET /openapi.json, generated from the pydantic request and response models."""

from functools import cache

from pydantic.json_schema import models_json_schema

from app.server import schemas as s

ROUTES = [
    # path, method, summary, request model, response model
    ("/v1/chat/completions", "post", "Chat completion (JSON, or SSE chunks with stream=true)",
     s.ChatCompletionRequest, s.ChatCompletionResponse),
    ("/v1/completions", "post", "Text completion (JSON, or SSE chunks with stream=true)",
     s.CompletionRequest, s.CompletionResponse),
    ("/v1/embeddings", "post", "Each input's last hidden state as a unit vector (float or base64)",
     s.EmbeddingRequest, s.EmbeddingResponse),
    ("/v1/models", "get", "The served model", None, s.ModelList),
    ("/tokenize", "post", "Text or chat messages to token ids", s.TokenizeRequest, None),
    ("/detokenize", "post", "Token ids to text", s.DetokenizeRequest, None),
    ("/health", "get", "200 when serving; 503 while loading or draining", None, None),
    ("/metrics", "get", "Prometheus metrics (spool: prefix, vLLM's names)", None, None),
]
# Routes that answer an event stream when asked (stream=true), and the model of each chunk.
STREAM_CHUNKS = {"/v1/chat/completions": "ChatCompletionChunk", "/v1/completions": "CompletionResponse"}


@cache
def _components() -> tuple[dict, dict]:
    models = {m for _, _, _, req, resp in ROUTES for m in (req, resp) if m} | {s.ErrorResponse, s.ChatCompletionChunk}
    keys, top = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                   ref_template="#/components/schemas/{model}")
    return {m: ref for (m, _), ref in keys.items()}, top.get("$defs", {})


def spec(model_name: str) -> dict:
    refs, schemas = _components()
    error = {"content": {"application/json": {"schema": refs[s.ErrorResponse]}}, "description": "OpenAI-shaped error"}
    paths: dict = {}
    for path, method, summary, req, resp in ROUTES:
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if resp is not None:
            op["responses"]["200"]["content"] = {"application/json": {"schema": refs[resp]}}
        if path in STREAM_CHUNKS:
            op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {  # one server-sent event
                "type": "object", "required": ["data"], "properties": {"data": {
                    "type": "string", "description": f"a {STREAM_CHUNKS[path]} as JSON, or [DONE] last"}}}}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[req]}}}
            op["responses"]["400"] = error
        op["responses"]["default"] = error
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Spool", "version": "0.1.0", "description": f"OpenAI-compatible server for {model_name}"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
