"""WS /v1/ws: several cancellable generations on one socket.

Client frames (JSON text):
  {"type": "generate", "id": "g1", ...a chat body (messages) or a completions body (prompt)}
  {"type": "cancel", "id": "g1"}
Server frames:
  {"type": "delta", "id": "g1", "index": 0, "text": "..."}
  {"type": "done", "id": "g1", "choices": [{"index", "finish_reason", "stop_reason"}], "usage": {...}}
    (with tools, each choice also has "tool_calls", read out of the text its deltas carried)
  {"type": "error", "id": "g1" or null, "error": {"message", "type", "param", "code"}}
A malformed frame gets an error frame and the socket stays open, as does a generate frame over
--ws-max-generations (an error frame with status 429) or over a request limit (400, as over
HTTP). Frames are read in order: a generate frame is decoded, checked and tokenized in a worker
thread (app/server/workers.py) before the next frame is read. Closing the socket cancels every
generation on it. With --api-key, the upgrade request needs the same Authorization header as HTTP.
An upgrade from a web page of another origin, or naming a host the server does not answer to,
gets the HTTP refusal (403, 400) in OpenAI's shape (app/server/origins.py): no CORS guards a
WebSocket, so this check is the only one.

Each generate frame gets a log line (method WS) with an HTTP-like status for how it ended: 200
done, 499 cancelled (a cancel frame, or the socket closed), 504 past --request-timeout, 500 an
engine error, or the refusal's status (400, 429...); the socket gets its own when it closes.
"""

import json
import time
from contextlib import aclosing

import trio
from quart import websocket

from app.server import access_log, chat_page, request_limits
from app.server.chat_text import ChatText, Reading
from app.server.errors import APIError, decode_json
from app.server.generation import Generation, Outcome
from app.server.prompts import start_generation
from app.server.schemas import ChatCompletionRequest, CompletionRequest
from app.server.state import ServerState
from app.server.workers import off_loop


async def websocket_route(state: ServerState):
    if refusal := state.origins.refusal(websocket.headers, websocket.path):
        return refusal.response()  # before accepting: the upgrade's answer
    if state.api_keys and not any(chat_page.key_offered(websocket, key) for key in state.api_keys):
        await websocket.close(1008, "missing or invalid API key")  # 1008: policy violation
        return
    if state.engine is None:
        await websocket.close(1013, "the model is still loading")  # 1013: try again later
        return
    if chat_page.SUBPROTOCOL in websocket.requested_subprotocols:  # a browser must get one back
        await websocket.accept(subprotocol=chat_page.SUBPROTOCOL)
    await serve_websocket(state)


def done_frame(gid: str, gen: Generation, reading: Reading) -> dict:
    """Each choice's end, with the tool calls read out of its text as the HTTP routes read them."""
    choices = []
    for c in gen.ordered():
        choice = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "error": c.error}
        if reading.tools:  # read out of the text, after any thinking
            split = ChatText(reading)
            split.feed(c.text, final=True)
            choice.update(tool_calls=split.tool_calls, finish_reason=split.finish_reason(c.finish_reason))
        choices.append(choice)
    return {"type": "done", "id": gid, "choices": choices, "usage": gen.usage().model_dump()}


def done_status(gen: Generation, outcome: Outcome) -> int:
    """The log line's status for a generation that sent its done frame."""
    if outcome.failure:
        return 500
    if any(c.finish_reason == "cancelled" for c in gen.choices.values()):
        return access_log.CLIENT_GONE
    return 200


async def serve_websocket(state: ServerState) -> None:
    lock = trio.Lock()
    generations: dict = {}  # id -> Generation in flight
    remote, path = websocket.remote_addr, websocket.path

    async def send(frame: dict) -> None:
        async with lock:
            await websocket.send(json.dumps(frame))

    async def send_error(gid, error: APIError) -> None:
        await send({"type": "error", "id": gid, "error": error.body()["error"]})

    async def run(gid: str, gen: Generation, reading: Reading) -> None:
        """gen.run()'s items as frames: a delta per piece with text, then an error frame (its
        refusal, its deadline) or the done frame."""
        status = access_log.CLIENT_GONE  # unless it gets further: the socket closed under it
        try:
            async with aclosing(gen.run()) as items:
                async for item in items:
                    if not isinstance(item, Outcome):
                        for piece in item:
                            if piece.text:
                                await send({"type": "delta", "id": gid, "index": piece.choice.index,
                                            "text": piece.text})
                    elif stopped := item.refusal or item.timeout:
                        status = stopped.status
                        await send_error(gid, stopped)
                    else:
                        status = done_status(gen, item)
                        await send(done_frame(gid, gen, reading))
        finally:
            del generations[gid]
            access_log.websocket_line(remote, path, status, gen.started, gen)

    def parse(message) -> tuple[str, str, dict]:
        frame = decode_json(message, "the frame")
        if not isinstance(frame, dict):
            raise APIError(400, "a frame must be a JSON object")
        kind, gid = frame.pop("type", None), frame.pop("id", None)
        if kind not in ("generate", "cancel"):
            raise APIError(400, f"unknown frame type {kind!r}; use generate or cancel", param="type")
        if not isinstance(gid, str) or not gid:
            raise APIError(400, "a frame needs a string id", param="id")
        return kind, gid, frame

    async def start(gid: str, body: dict):
        if gid in generations:
            raise APIError(400, f"generation {gid!r} is already running on this socket", param="id")
        if len(generations) >= state.limits.ws_max_generations:
            raise APIError(429, f"{len(generations)} generations are already running on this socket"
                                f" (--ws-max-generations)", code="too_many_generations")
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        req = await off_loop(state, request_limits.validated, model, body, state.limits, state.max_queue)
        state.check_model(req.model)
        return await start_generation(state, req, "ws")

    async with trio.open_nursery() as nursery:
        while True:
            message = await websocket.receive()
            received, gid = time.monotonic(), None
            try:
                kind, gid, body = await off_loop(state, parse, message)
                if kind == "cancel":
                    if gid not in generations:
                        raise APIError(400, f"no generation {gid!r} is running on this socket", param="id")
                    generations[gid].abort()
                else:
                    generations[gid], reading = await start(gid, body)
                    nursery.start_soon(run, gid, generations[gid], reading)
            except APIError as e:
                access_log.websocket_line(remote, path, e.status, received)
                await send_error(gid, e)
