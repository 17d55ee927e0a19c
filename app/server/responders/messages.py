"""/v1/messages: a generation as Anthropic's message, or as its stream of typed events
(message_start, then per content block content_block_start, its deltas and content_block_stop,
then message_delta with the stop reason and usage, and message_stop).

One MessageBlocks turns the chat split of the text (app/server/responders/chat.py's ChatText:
thinking, text, tool calls) into content blocks; the JSON reply is the same machine fed the
whole text at once, so a streamed message accumulates to the reply's blocks by construction.
Text is trimmed at its ends (the whitespace a template writes around tool calls), and a message
with no block at all gets one empty text block, as Anthropic's replies always carry content.
"""

import json

from app.server.errors import APIError
from app.server.generation import Choice, Generation
from app.server.messages_schemas import MessageResponse, MessageUsage
from app.server.responders.chat import ChatText
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


class MessageBlocks:
    """Content blocks as a message's text settles: each feed gives the stream events it makes,
    and blocks holds every block so far in the reply's shape."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open: str | None = None  # the kind of the last block while it is open
        self.held = ""  # text not yet sent: leading whitespace, or whitespace that may end the text

    def feed(self, reasoning: str, text: str, calls: list[dict], final: bool = False) -> list[tuple[str, dict]]:
        events = []
        if reasoning:
            events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events += self._delta("thinking", reasoning)
        held = self.held + text
        if held.strip():
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
                held = held.lstrip()
            body = held.rstrip()
            events += self._delta("text", body)
            held = held[len(body):]
        self.held = held
        for chunk in calls:
            if "id" in chunk:
                events += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(chunk["id"]),
                                                   "name": chunk["function"]["name"], "input": {}})
            events += self._delta("tool_use", chunk["function"]["arguments"])
        if final:
            if not self.blocks:
                events += self._start("text", {"type": "text", "text": ""})
            events += self._stop()
        return events

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        if self.open == kind and kind != "tool_use":
            return []
        events = self._stop()
        self.open = kind
        self.blocks.append(dict(block, arguments="") if kind == "tool_use" else dict(block))
        return events + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": block})]

    def _delta(self, kind: str, piece: str) -> list[tuple[str, dict]]:
        if not piece:
            return []
        block = self.blocks[-1]
        if kind == "thinking":
            block["thinking"] += piece
            delta = {"type": "thinking_delta", "thinking": piece}
        elif kind == "text":
            block["text"] += piece
            delta = {"type": "text_delta", "text": piece}
        else:
            block["arguments"] += piece
            delta = {"type": "input_json_delta", "partial_json": piece}
        return [("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                         "delta": delta})]

    def _stop(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open, self.held = None, ""
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def content(self) -> list[dict]:
        """The blocks in the reply's shape: a tool call's arguments as its input object."""
        return [{k: v for k, v in b.items() if k != "arguments"} | {"input": tool_input(b["arguments"])}
                if b["type"] == "tool_use" else b for b in self.blocks]


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object; {} for a call cut short by max_tokens."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesResponder:
    def __init__(self, gen: Generation, model_name: str):
        self.gen, self.model_name = gen, model_name

    def message(self, choice: Choice, content: list[dict], called: bool) -> MessageResponse:
        reason, sequence = stop_reason(choice, called)
        return MessageResponse(id=self.gen.id, model=self.model_name, content=content, stop_reason=reason,
                               stop_sequence=sequence, usage=usage(choice))

    def reply(self) -> dict:
        (choice,) = self.gen.ordered()
        split, blocks = ChatText(self.gen), MessageBlocks()
        blocks.feed(*split.feed(choice.text, final=True), final=True)
        return self.message(choice, blocks.content(), bool(split.tool_calls)).model_dump()

    async def events(self):
        """The whole event stream; an error after the 200 is an error event, as Anthropic's."""
        gen = self.gen
        with gen.submitted() as refusal:
            if refusal:
                yield error_event(refusal)
                return
            (choice,) = gen.ordered()
            split, blocks = ChatText(gen), MessageBlocks()
            start = MessageResponse(id=gen.id, model=self.model_name, content=[], stop_reason=None,
                                    usage=MessageUsage(input_tokens=choice.prompt_tokens, output_tokens=0))
            yield named_event("message_start", {"type": "message_start", "message": start.model_dump()})
            yield named_event("ping", {"type": "ping"})
            async for pieces in gen.batches():
                for piece in pieces:
                    final = piece.final is not None
                    for name, payload in blocks.feed(*split.feed(piece.text, final=final), final=final):
                        yield named_event(name, payload)
            failure = gen.timeout_error() if gen.timed_out else gen.failure()
            if failure:
                yield error_event(failure)
                return
            reason, sequence = stop_reason(choice, bool(split.tool_calls))
            yield named_event("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": usage(choice).model_dump()})
            yield named_event("message_stop", {"type": "message_stop"})


def error_event(error: APIError) -> str:
    return named_event("error", error.anthropic_body())
