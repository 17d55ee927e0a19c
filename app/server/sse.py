"""Server-sent events: a Generation's chunks, as a responder shapes them, one `data:` event
each, then an error or the usage chunk, then `data: [DONE]`, as OpenAI streams.

An error after the 200 has gone (a refusal at submit, the deadline, an engine error) is an
event of its own, in OpenAI's error shape.
"""

import json
from contextlib import aclosing

from pydantic import BaseModel

from app.server.generation import Generation, Outcome
from app.server.responders.base import Responder

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict) -> str:
    body = json.dumps(payload) if isinstance(payload, dict) else payload.model_dump_json(exclude_none=False)
    return f"data: {body}\n\n"


def named_event(name: str, payload: dict) -> str:
    """An event with its type on an `event:` line, as Anthropic's and OpenAI's Responses
    streams carry them (their clients dispatch on it)."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


async def events(gen: Generation, responder: Responder, include_usage: bool):
    """Every event of gen.run(), until every choice ends; leaving early (the client gone)
    aborts them."""
    async with aclosing(gen.run()) as items:
        async for item in items:
            if not isinstance(item, Outcome):
                for chunk in responder.chunks(item):
                    yield event(chunk)
                continue
            for error in (item.refusal, item.timeout, item.failure):
                if error:
                    yield event(error.body())
            if include_usage and not (item.refusal or item.failure):
                yield event(responder.usage_chunk())
            yield DONE


def stream(gen: Generation, responder: Responder, req) -> tuple:
    """The response: the events and their headers; with stream_options.include_usage, a last
    chunk carries the usage."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return events(gen, responder, include_usage), HEADERS
