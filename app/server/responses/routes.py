"""OpenAI's POST /v1/responses, run as the chat request its conversation stands for
(chat_request.py, with its tools as tools.py makes them) and kept for previous_response_id
unless store is false; GET and DELETE /v1/responses/{id} read the store (store.py). Hosted
tools left out are named in the Spool-Skipped-Tools header, of a reply and of a stream alike."""

from quart import request

from app.server import keys, request_limits
from app.server.openapi import Documented
from app.server.prompts import start_generation
from app.server.responses.chat_request import chat_request, input_items
from app.server.responses.responder import ResponsesResponder
from app.server.responses.schemas import DeletedResponse, ResponseObject, ResponsesRequest
from app.server.responses.store import new_id
from app.server.responses.tools import Toolbox
from app.server.schemas import ChatCompletionRequest
from app.server.sse import HEADERS
from app.server.state import ServerState
from app.server.workers import off_loop, parse


def owner(state: ServerState) -> str:
    """Whose stored responses this request may read: the key it presented (app/server/keys.py)."""
    return keys.owner(keys.presented(request.headers, state.api_keys))


async def create_response(state: ServerState):
    req = await parse(state, ResponsesRequest)
    state.check_model(req.model)
    key_owner = owner(state)  # read now: a stream's keep runs after the request's context is gone
    earlier = state.responses.get(key_owner, req.previous_response_id, "previous_response_id").conversation \
        if req.previous_response_id else []

    def conversation_and_chat() -> tuple[list[dict], Toolbox, ChatCompletionRequest]:
        conversation = earlier + input_items(req)
        request_limits.at_most("input", "items with the conversation it continues", len(conversation),
                               state.limits.max_messages, "--max-messages")
        toolbox = Toolbox(req.tools)
        return conversation, toolbox, chat_request(req, conversation, toolbox)

    conversation, toolbox, chat = await off_loop(state, conversation_and_chat)
    response_id = new_id()
    gen, reading = await start_generation(state, chat, response_id, fit_context=True)
    toolbox.log_skipped(response_id)

    def keep(response: dict, output: list[dict]) -> None:
        if req.store:
            state.responses.put(key_owner, response, conversation + output)

    responder = ResponsesResponder(gen, reading, req, toolbox, state.model_name, response_id, keep)
    if req.stream:
        return responder.events(), {**HEADERS, **toolbox.headers()}
    await gen.collect()
    return responder.reply(), toolbox.headers()


async def get_response(state: ServerState, response_id: str):
    return state.responses.get(owner(state), response_id).response


async def delete_response(state: ServerState, response_id: str):
    state.responses.delete(owner(state), response_id)
    return DeletedResponse(id=response_id).model_dump()


ROUTES = [
    ("POST", "/v1/responses", create_response),
    ("GET", "/v1/responses/<response_id>", get_response),
    ("DELETE", "/v1/responses/<response_id>", delete_response),
]
DOCUMENTED = [
    Documented("/v1/responses", "post", "OpenAI's Responses API (JSON, or typed SSE events with stream=true)",
               ResponsesRequest, ResponseObject,
               "one of the Responses API's typed events as JSON, named on its event: line"),
    Documented("/v1/responses/{response_id}", "get", "A stored response", response=ResponseObject),
    Documented("/v1/responses/{response_id}", "delete", "Forget a stored response", response=DeletedResponse),
]
