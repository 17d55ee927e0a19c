"""Server-sent events, as the APIs' streams frame them: OpenAI's `data:` events (and its last
`data: [DONE]`), and the typed events of Anthropic's and the Responses API's streams, whose
name also goes on an `event:` line."""

import json

from pydantic import BaseModel

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict) -> str:
    body = json.dumps(payload) if isinstance(payload, dict) else payload.model_dump_json(exclude_none=False)
    return f"data: {body}\n\n"


def named_event(name: str, payload: dict) -> str:
    """An event with its type on an `event:` line, as Anthropic's and OpenAI's Responses
    streams carry them (their clients dispatch on it)."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"
