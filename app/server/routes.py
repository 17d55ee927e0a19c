"""The HTTP routes, each a module function over the ServerState that create_app binds to it:
read and check the request, then hand it to a responder, the tokenizer or the engine. What
takes time in proportion to the body (decoding it, validating it, rendering and tokenizing its
prompts) runs in a worker thread (app/server/workers.py), after the request limits are checked.

A generation route answers JSON, or server-sent events with stream=true; both run the request
through one Generation, which owns submit, abort, the deadline and the access log.
"""

from quart import request

from app.server import embeddings, keys, messages, metrics, openapi, request_limits, responses
from app.server.errors import APIError
from app.server.generation import RETRY_AFTER_SECONDS, Generation
from app.server.prompts import chat_tokens, check_embeddings, start_generation
from app.server.responders.chat import ChatResponder
from app.server.responders.completions import CompletionResponder
from app.server.responders.messages import MessagesResponder
from app.server.responders.responses import ResponsesResponder
from app.server.response_store import new_id
from app.server.responses_schemas import DeletedResponse, ResponsesRequest
from app.server.messages_schemas import CountTokensRequest, CountTokensResponse, MessagesRequest
from app.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from app.server.sse import HEADERS, stream
from app.server.state import ServerState
from app.server.workers import json_reply, off_loop


async def parse(state: ServerState, model):
    """The request body as model, within the request limits (app/server/request_limits.py), or
    a 400; no body reads as null."""
    raw = await request.get_data() or b"null"
    return await off_loop(state, request_limits.parse, model, raw, state.limits, state.max_queue)


async def answer(gen: Generation, req, responder):
    """The events with stream=true, else the JSON reply once every choice has ended."""
    if req.stream:
        return stream(gen, responder, req)
    await gen.collect()
    return responder.reply()


async def chat_completions(state: ServerState):
    req = await parse(state, ChatCompletionRequest)
    state.check_model(req.model)
    gen, reading = await start_generation(state, req, "chatcmpl")
    return await answer(gen, req, ChatResponder(gen, reading, req, state.tokenizer, state.model_name))


async def completions(state: ServerState):
    req = await parse(state, CompletionRequest)
    state.check_model(req.model)
    gen, _ = await start_generation(state, req, "cmpl")
    return await answer(gen, req, CompletionResponder(gen, req, state.tokenizer, state.model_name))


async def create_embeddings(state: ServerState):
    """OpenAI's /v1/embeddings: each input's last hidden state, unit length, batched by the
    engine with everything else."""
    req = await parse(state, EmbeddingRequest)
    state.check_model(req.model)
    embeddings.check_dimensions(req, state.engine.runner.config.hidden_size)
    submissions = await off_loop(state, check_embeddings, state, req)
    gen = Generation(state.engine, submissions, "embd", state.request_timeout)
    await gen.collect()
    return embeddings.reply(gen, req, state.model_name)


async def create_message(state: ServerState):
    """Anthropic's /v1/messages, run as the chat request it stands for (app/server/messages.py)."""
    req = await parse(state, MessagesRequest)
    state.check_model(req.model)
    chat = await off_loop(state, messages.chat_request, req)
    gen, reading = await start_generation(state, chat, "msg", fit_context=True)
    responder = MessagesResponder(gen, reading, state.model_name)
    if req.stream:
        return responder.events(), HEADERS
    await gen.collect()
    return responder.reply()


async def count_message_tokens(state: ServerState):
    """Anthropic's /v1/messages/count_tokens: the prompt's length with its tools, as
    /v1/messages would run it."""
    req = await parse(state, CountTokensRequest)
    state.check_model(req.model)
    tokens = await off_loop(state, lambda: chat_tokens(state, messages.chat_request(req)))
    return CountTokensResponse(input_tokens=len(tokens)).model_dump()


def owner(state: ServerState) -> str:
    """Whose stored responses this request may read: the key it presented (app/server/keys.py)."""
    return keys.owner(keys.presented(request.headers, state.api_keys))


async def create_response(state: ServerState):
    """OpenAI's /v1/responses, run as the chat request its conversation stands for
    (app/server/responses.py); kept for previous_response_id unless store is false."""
    req = await parse(state, ResponsesRequest)
    state.check_model(req.model)
    key_owner = owner(state)  # read now: a stream's keep runs after the request's context is gone
    earlier = state.responses.get(key_owner, req.previous_response_id, "previous_response_id").conversation \
        if req.previous_response_id else []

    def conversation_and_chat() -> tuple[list[dict], ChatCompletionRequest]:
        conversation = earlier + responses.input_items(req)
        request_limits.at_most("input", "items with the conversation it continues", len(conversation),
                               state.limits.max_messages, "--max-messages")
        return conversation, responses.chat_request(req, conversation)

    conversation, chat = await off_loop(state, conversation_and_chat)
    response_id = new_id()
    gen, reading = await start_generation(state, chat, response_id, fit_context=True)

    def keep(response: dict, output: list[dict]) -> None:
        if req.store:
            state.responses.put(key_owner, response, conversation + output)

    responder = ResponsesResponder(gen, reading, req, state.model_name, response_id, keep)
    if req.stream:
        return responder.events(), HEADERS
    await gen.collect()
    return responder.reply()


async def get_response(state: ServerState, response_id: str):
    return state.responses.get(owner(state), response_id).response


async def delete_response(state: ServerState, response_id: str):
    state.responses.delete(owner(state), response_id)
    return DeletedResponse(id=response_id).model_dump()


async def models(state: ServerState):
    return ModelList(data=[model_card(state, name) for name in state.model_names]).model_dump()


async def model(state: ServerState, model_id: str):
    """GET /v1/models/{id}: the served model's card under any of its names (what openai's
    models.retrieve reads), or a 404 for any other id."""
    state.check_model(model_id or None)
    return model_card(state, model_id).model_dump()


def model_card(state: ServerState, name: str) -> ModelCard:
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


async def openapi_spec(state: ServerState):
    return openapi.spec(state.model_name)
