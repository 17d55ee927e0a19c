"""The server's own HTTP routes, beside the APIs' (each in its folder): the model list, health,
metrics, tokenize and detokenize. Each is a module function over the ServerState that
create_app binds to it; what takes time in proportion to the body runs in a worker thread
(app/server/workers.py), after the request limits are checked.
"""

from app.server import metrics
from app.server.errors import APIError
from app.server.generation import RETRY_AFTER_SECONDS
from app.server.openapi import Documented
from app.server.prompts import chat_tokens
from app.server.schemas import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from app.server.state import ServerState
from app.server.workers import json_reply, off_loop, parse


async def models(state: ServerState):
    return ModelList(data=[model_card(state, name) for name in state.model_names]).model_dump(exclude_none=True)


async def model(state: ServerState, model_id: str):
    """GET /v1/models/{id}: the served model's card under any of its names (what openai's
    models.retrieve reads), or a 404 for any other id."""
    state.check_model(model_id or None)
    return model_card(state, model_id).model_dump(exclude_none=True)


def model_card(state: ServerState, name: str) -> ModelCard:
    adapter = state.adapters.served.get(name) if state.adapters is not None else None
    if adapter is not None:
        return ModelCard(id=name, max_model_len=state.max_model_len, root=adapter.path, parent=state.model_name)
    return ModelCard(id=name, max_model_len=state.max_model_len)


async def health(state: ServerState):
    if state.engine is None:
        return APIError(503, "the model is still loading", code="loading").response()
    status = state.engine.status()
    if status["running"]:
        return {"status": "ok"}
    reason = "draining" if status["draining"] else "the engine is not running"
    return APIError(503, reason, code="unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()


async def prometheus(state: ServerState):
    body, content_type = metrics.render(state.engine, state.model_name, state.backend, state.connections)
    return body, 200, {"Content-Type": content_type}


async def tokenize(state: ServerState):
    req = await parse(state, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        tokens = await off_loop(state, chat_tokens, state, req)
    else:
        tokens = await off_loop(state, state.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    return await json_reply(state, {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len})


async def detokenize(state: ServerState):
    req = await parse(state, DetokenizeRequest)
    state.check_model(req.model)
    return {"prompt": await off_loop(state, detokenized, state.tokenizer, req.tokens)}


def detokenized(tokenizer, tokens: list[int]) -> str:
    vocab = tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return tokenizer.decode(tokens, skip_special_tokens=False)


ROUTES = [
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/<path:model_id>", model),
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]
DOCUMENTED = [
    Documented("/v1/models", "get", "The served model", response=ModelList),
    Documented("/v1/models/{model_id}", "get", "The served model's card; 404 for any other id", response=ModelCard),
    Documented("/tokenize", "post", "Text or chat messages to token ids", TokenizeRequest),
    Documented("/detokenize", "post", "Token ids to text", DetokenizeRequest),
    Documented("/health", "get", "200 when serving; 503 while loading or draining"),
    Documented("/metrics", "get", "Prometheus metrics (spool: prefix, vLLM's names)"),
]
