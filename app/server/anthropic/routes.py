"""Anthropic's POST /v1/messages, run as the chat request it stands for (chat_request.py), and
/v1/messages/count_tokens. Their errors come in Anthropic's shape (app/server/app.py asks
error_body here for every path under PREFIX)."""

from app.server.anthropic.chat_request import chat_request, unapplied_edits
from app.server.anthropic.responder import MessagesResponder
from app.server.anthropic.schemas import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from app.server.openapi import Documented
from app.server.prompts import chat_tokens, start_generation
from app.server.sse import HEADERS
from app.server.state import ServerState
from app.server.workers import off_loop, parse

PREFIX = "/v1/messages"  # the paths whose errors are Anthropic's
SKIPPED_EDITS = "Spool-Skipped-Context-Edits"  # the context_management edits taken and not applied


async def create_message(state: ServerState):
    req = await parse(state, MessagesRequest)
    state.check_model(req.model)
    chat = await off_loop(state, chat_request, req)
    gen, reading = await start_generation(state, chat, "msg", fit_context=True)
    responder = MessagesResponder(gen, reading, state.model_name)
    skipped = unapplied_edits(req.context_management)
    headers = {SKIPPED_EDITS: ", ".join(skipped)} if skipped else {}
    if req.stream:
        return responder.events(), {**HEADERS, **headers}
    await gen.collect()
    return responder.reply(), headers


async def count_message_tokens(state: ServerState):
    """The prompt's length with its tools, as /v1/messages would run it."""
    req = await parse(state, CountTokensRequest)
    state.check_model(req.model)
    tokens = await off_loop(state, lambda: chat_tokens(state, chat_request(req)))
    return CountTokensResponse(input_tokens=len(tokens)).model_dump()


ROUTES = [
    ("POST", "/v1/messages", create_message),
    ("POST", "/v1/messages/count_tokens", count_message_tokens),
]
DOCUMENTED = [
    Documented("/v1/messages", "post", "Anthropic's Messages API (JSON, or typed SSE events with stream=true)",
               MessagesRequest, MessageResponse, "one of Anthropic's typed events as JSON, named on its event: line",
               AnthropicErrorResponse, "Anthropic"),
    Documented("/v1/messages/count_tokens", "post", "The prompt length of a Messages request, tools included",
               CountTokensRequest, CountTokensResponse, error=AnthropicErrorResponse, shape="Anthropic"),
]
