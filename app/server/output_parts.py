"""A choice's output as typed parts, for the APIs whose replies are lists of them (Anthropic's
content blocks, the Responses API's output items): thinking, text and tool calls, each opened,
written in pieces and closed as the text settles.

OutputParts takes what ChatText (app/server/chat_text.py) splits from the text and gives the
events a stream sends; a JSON reply is the same machine fed the whole text at once, so a
stream's parts accumulate to the reply's by construction. Text is trimmed at its ends (the
whitespace a template writes around tool calls), and an output with no part at all gets one
empty text part, as both APIs' replies always carry one.
"""

from dataclasses import dataclass


@dataclass
class Part:
    kind: str  # "thinking", "text" or "call"
    text: str = ""  # the thinking, the text, or a call's arguments (JSON) as written so far
    call_id: str = ""
    name: str = ""


# What a feed gives: ("start", index), ("delta", index, piece) and ("stop", index), in order.
Event = tuple


class OutputParts:
    def __init__(self):
        self.parts: list[Part] = []
        self.open = False  # whether the last part is still being written
        self.held = ""  # text not yet sent: leading whitespace, or whitespace that may end the text

    def feed(self, reasoning: str, text: str, calls: list[dict], final: bool = False) -> list[Event]:
        """The events that a piece of split output makes; final: the output has ended."""
        events = []
        if reasoning:
            events += self._start(Part("thinking")) + self._delta(reasoning)
        held = self.held + text
        if held.strip():
            if not self._writing("text"):
                events += self._start(Part("text"))
                held = held.lstrip()
            body = held.rstrip()
            events += self._delta(body)
            held = held[len(body):]
        self.held = held
        for chunk in calls:
            if "id" in chunk:
                events += self._start(Part("call", call_id=chunk["id"], name=chunk["function"]["name"]))
            events += self._delta(chunk["function"]["arguments"])
        if final:
            if not self.parts:
                events += self._start(Part("text"))
            events += self._stop()
        return events

    def _writing(self, kind: str) -> bool:
        return self.open and self.parts[-1].kind == kind

    def _start(self, part: Part) -> list[Event]:
        if part.kind != "call" and self._writing(part.kind):
            return []
        events = self._stop()
        self.parts.append(part)
        self.open = True
        return events + [("start", len(self.parts) - 1)]

    def _delta(self, piece: str) -> list[Event]:
        if not piece:
            return []
        self.parts[-1].text += piece
        return [("delta", len(self.parts) - 1, piece)]

    def _stop(self) -> list[Event]:
        if not self.open:
            return []
        self.open, self.held = False, ""
        return [("stop", len(self.parts) - 1)]
