"""POST /v1/chat/completions and /v1/completions: the request checked, its choices run as one
Generation, and answered by the shape's responder as JSON, or as events with stream=true."""

from app.server.generation import Generation
from app.server.openai.chat import ChatResponder
from app.server.openai.completions import CompletionResponder
from app.server.openai.schemas import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from app.server.openai.stream import stream
from app.server.openapi import Documented
from app.server.prompts import start_generation
from app.server.schemas import ChatCompletionRequest, CompletionRequest
from app.server.state import ServerState
from app.server.workers import parse


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


ROUTES = [
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
]
DOCUMENTED = [
    Documented("/v1/chat/completions", "post", "Chat completion (JSON, or SSE chunks with stream=true)",
               ChatCompletionRequest, ChatCompletionResponse, "a ChatCompletionChunk as JSON, or [DONE] last",
               also=(ChatCompletionChunk,)),
    Documented("/v1/completions", "post", "Text completion (JSON, or SSE chunks with stream=true)",
               CompletionRequest, CompletionResponse, "a CompletionResponse as JSON, or [DONE] last"),
]
