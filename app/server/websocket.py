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
--ws-max-generations (an error frame with status 429). Closing the socket cancels every
generation on it. With --api-key, the upgrade request needs the same Authorization header as HTTP.
"""

import json

import trio
from quart import websocket

from app.server.errors import APIError, decode_json, validate
from app.server.generation import ChatText, merge, start_generation
from app.server.schemas import ChatCompletionRequest, CompletionRequest


async def serve_websocket(state) -> None:
    lock = trio.Lock()
    generations: dict = {}  # id -> Generation in flight

    async def send(frame: dict) -> None:
        async with lock:
            await websocket.send(json.dumps(frame))

    async def send_error(gid, error: APIError) -> None:
        await send({"type": "error", "id": gid, "error": error.body()["error"]})

    async def run(gid: str, gen) -> None:
        try:
            try:
                gen.submit()
            except APIError as e:
                await send_error(gid, e)
                return
            until = state.deadline()
            while not gen.done:
                frames = await gen.next_frames(until)
                if frames is None:
                    gen.abort()
                    await send_error(gid, state.timeout_error())
                    return
                for rid, (text, _, _) in merge(frames).items():
                    choice = gen.choices[rid]
                    if text:
                        await send({"type": "delta", "id": gid, "index": choice.index, "text": text})
            choices = []
            for c in sorted(gen.choices.values(), key=lambda c: c.index):
                choice = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                          "error": c.error}
                if gen.tools:  # read out of the text, after any thinking, as the HTTP routes read it
                    split = ChatText(gen)
                    split.feed(c.text, final=True)
                    choice.update(tool_calls=split.tool_calls, finish_reason=split.finish_reason(c.finish_reason))
                choices.append(choice)
            await send({"type": "done", "id": gid, "choices": choices, "usage": gen.usage().model_dump()})
        finally:
            gen.abort()
            gen.log()
            del generations[gid]

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

    def start(gid: str, body: dict):
        if gid in generations:
            raise APIError(400, f"generation {gid!r} is already running on this socket", param="id")
        if len(generations) >= state.limits.ws_max_generations:
            raise APIError(429, f"{len(generations)} generations are already running on this socket"
                                f" (--ws-max-generations)", code="too_many_generations")
        req = validate(ChatCompletionRequest if "messages" in body else CompletionRequest, body)
        state.check_model(req.model)
        return start_generation(state.engine, state.tokenizer, req, "ws")

    async with trio.open_nursery() as nursery:
        while True:
            message = await websocket.receive()
            gid = None
            try:
                kind, gid, body = parse(message)
                if kind == "cancel":
                    if gid not in generations:
                        raise APIError(400, f"no generation {gid!r} is running on this socket", param="id")
                    generations[gid].abort()
                else:
                    generations[gid] = start(gid, body)
                    nursery.start_soon(run, gid, generations[gid])
            except APIError as e:
                await send_error(gid, e)
