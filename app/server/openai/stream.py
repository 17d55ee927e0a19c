"""A chat or completion stream: gen.run()'s items as server-sent events, each chunk a `data:`
event as the responder shapes it, then an error or the usage chunk, then `data: [DONE]`, as
OpenAI streams.

An error after the 200 has gone (a refusal at submit, the deadline, an engine error) is an
event of its own, in OpenAI's error shape.
"""

from contextlib import aclosing

from app.server.generation import Generation, Outcome
from app.server.openai.responder import Responder
from app.server.sse import DONE, HEADERS, event


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
