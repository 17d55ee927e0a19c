"""A chat's output text as it streams, split into reasoning, content and tool calls: what the
chat completion, the Messages and Responses replies and the WebSocket's done frame all read out
of a choice's text, so every API splits it alike."""

from collections.abc import Callable
from dataclasses import dataclass

from app.server.reasoning import ReasoningParser
from app.server.tools import ToolUse
from app.server.tools.base import CallStream
from model.tokenizer import THINK_TAGS


@dataclass(frozen=True)
class Reading:
    """How to read a request's output, settled with its prompt: the tools it offered (whose
    format writes the calls), and for a reasoning model's chat whether the prompt opened the
    thinking (None: no thinking to split off), or a reader of the whole reply where the model
    writes its reasoning, content and calls as one structure (GPT-OSS's harmony, Kimi K3's
    XTML). Nothing set: the text is all content."""

    tools: ToolUse | None = None
    thinks_from: bool | None = None
    whole: Callable[[], CallStream] | None = None  # gives one reader a choice, with take_reasoning()
    think_tags: tuple[str, str] = THINK_TAGS[0]  # the tags the model thinks between


class ChatText:
    """One chat choice's text, as it streams, split into reasoning, content and tool calls."""

    def __init__(self, reading: Reading):
        self.reasoning = ReasoningParser(reading.thinks_from, reading.think_tags) \
            if reading.thinks_from is not None else None
        self.whole = reading.whole() if reading.whole else None  # one reader reads all three
        self.calls = self.whole or (reading.tools.parser() if reading.tools else None)
        self.tools = reading.tools

    @property
    def thinks(self) -> bool:
        """Whether the model thinks: its reasoning_content is given, empty or not."""
        return bool(self.reasoning or self.whole)

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool call chunks) that text settles; final: all that is left."""
        reasoning, content, chunks = "", text, []
        if self.reasoning:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.calls:
            content, chunks = self.calls.feed(content)
            if final:
                content += self.calls.finish()
        if self.whole:
            reasoning = self.whole.take_reasoning()
        return reasoning, content, chunks if self.tools else []

    @property
    def tool_calls(self) -> list[dict]:
        """The calls read so far, each with all its arguments written so far."""
        return self.calls.calls if self.calls and self.tools else []

    def finish_reason(self, reason: str) -> str:
        return self.tools.finish_reason(reason, bool(self.tool_calls)) if self.tools else reason
