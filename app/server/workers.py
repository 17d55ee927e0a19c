"""A request's own work, off the event loop: decoding and validating its body, rendering the
chat template, tokenizing and compiling grammars take time in proportion to what the client
sent, so they run in worker threads, at most --request-threads at once (the rest wait their
turn), and the event loop keeps answering /health and streaming tokens meanwhile. A reply as
long as its body (the token ids of /tokenize and the render routes) is written to JSON here too.

What runs here must be pure: the engine's state (its queue, submit, abort) is touched on the
event loop only; engine.check and the grammar cache it fills are safe from any thread.
"""

import functools
import json

import trio
from quart import request

from app.server import request_limits
from app.server.state import ServerState


async def off_loop(state: ServerState, fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread, once one is free."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=state.workers)


async def parse(state: ServerState, model):
    """The request body as model, within the request limits (app/server/request_limits.py), or
    a 400; no body reads as null."""
    raw = await request.get_data() or b"null"
    return await off_loop(state, request_limits.parse, model, raw, state.limits, state.max_queue)


async def json_reply(state: ServerState, payload: dict) -> tuple[str, int, dict]:
    """payload as a JSON response, written in a worker thread."""
    return await off_loop(state, to_json, payload), 200, {"Content-Type": "application/json"}


SLICE = 8192  # list items per json.dumps call: about a millisecond holding the GIL


def to_json(payload: dict) -> str:
    """payload as compact JSON, its long lists (token ids) a slice at a time: one json.dumps
    call holds the GIL throughout, and a million ids would hold up the event loop ~100 ms."""
    def dumps(value) -> str:
        if isinstance(value, list) and len(value) > SLICE:
            return "[" + ",".join(dumps(value[i:i + SLICE])[1:-1] for i in range(0, len(value), SLICE)) + "]"
        return json.dumps(value, separators=(",", ":"))

    return "{" + ",".join(f"{json.dumps(key)}:{dumps(value)}" for key, value in payload.items()) + "}"
