"""/v1/messages: a generation as Anthropic's message, or as its stream of typed events
(message_start, then per content block content_block_start, its deltas and content_block_stop,
then message_delta with the stop reason and usage, and message_stop).

Content blocks are the output's parts (app/server/output_parts.py: thinking, text, tool
calls), so a streamed message accumulates to the JSON reply's blocks by construction.
"""

import json
from contextlib import aclosing

from app.server.anthropic.schemas import MessageResponse, MessageUsage, error_body
from app.server.chat_text import ChatText, Reading
from app.server.generation import Choice, Generation, Outcome, Piece
from app.server.output_parts import OutputParts, Part
from app.server.sse import named_event


def stop_reason(choice: Choice, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how a choice ended."""
    if called:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def usage(choice: Choice) -> MessageUsage:
    return MessageUsage(input_tokens=choice.prompt_tokens - choice.cached_tokens,
                        output_tokens=choice.completion_tokens, cache_read_input_tokens=choice.cached_tokens)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def block(part: Part) -> dict:
    """A part as Anthropic's content block, as written so far."""
    if part.kind == "thinking":
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    if part.kind == "text":
        return {"type": "text", "text": part.text}
    return {"type": "tool_use", "id": tool_use_id(part.call_id), "name": part.name, "input": tool_input(part.text)}


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object; {} for a call cut short by max_tokens."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "call": ("input_json_delta", "partial_json")}


def stream_events(parts: OutputParts, events: list) -> list[tuple[str, dict]]:
    """Anthropic's content block events for the parts' events."""
    out = []
    for kind, index, *piece in events:
        if kind == "start":
            opened = block(Part(parts.parts[index].kind, call_id=parts.parts[index].call_id,
                                name=parts.parts[index].name))
            out.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": opened}))
        elif kind == "delta":
            delta_type, field = DELTAS[parts.parts[index].kind]
            out.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": delta_type, field: piece[0]}}))
        else:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return out


class MessagesResponder:
    """One Messages request's reply, or its stream: gen.run()'s items as Anthropic's events."""

    def __init__(self, gen: Generation, reading: Reading, model_name: str):
        self.gen, self.reading, self.model_name = gen, reading, model_name
        (self.choice,) = gen.ordered()
        self.split, self.parts = ChatText(reading), OutputParts()  # what a stream has read so far

    def message(self, choice: Choice, content: list[dict], called: bool) -> MessageResponse:
        reason, sequence = stop_reason(choice, called)
        return MessageResponse(id=self.gen.id, model=self.model_name, content=content, stop_reason=reason,
                               stop_sequence=sequence, usage=usage(choice))

    def reply(self) -> dict:
        split, parts = ChatText(self.reading), OutputParts()
        parts.feed(*split.feed(self.choice.text, final=True), final=True)
        return self.message(self.choice, [block(p) for p in parts.parts], bool(split.tool_calls)).model_dump()

    async def events(self):
        """The whole event stream; an error after the 200 is an error event, as Anthropic's."""
        async with aclosing(self.gen.run()) as items:
            async for item in items:
                for name, payload in self.run_events(item):
                    yield named_event(name, payload)

    def run_events(self, item: list[Piece] | Outcome) -> list[tuple[str, dict]]:
        """The events one of run()'s items makes: the opening for the first, empty batch, the
        content blocks' events for a batch, and for the outcome an error or the stop reason,
        the usage and the end."""
        choice = self.choice
        if isinstance(item, Outcome):
            if item.error:
                return [("error", error_body(item.error))]
            reason, sequence = stop_reason(choice, bool(self.split.tool_calls))
            return [("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                          "stop_sequence": sequence},
                                       "usage": usage(choice).model_dump()}),
                    ("message_stop", {"type": "message_stop"})]
        if not item:
            start = MessageResponse(id=self.gen.id, model=self.model_name, content=[], stop_reason=None,
                                    usage=MessageUsage(input_tokens=choice.prompt_tokens, output_tokens=0))
            return [("message_start", {"type": "message_start", "message": start.model_dump()}),
                    ("ping", {"type": "ping"})]
        out = []
        for piece in item:
            final = piece.final is not None
            out += stream_events(self.parts, self.parts.feed(*self.split.feed(piece.text, final=final), final=final))
        return out
