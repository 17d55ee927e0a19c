"""Kimi K3's replies, in XTML: sections opened by <|open|>NAME<|sep|> and closed by
<|close|>NAME<|sep|>, the thinking, then the response (the content), then maybe the tool calls
(app/server/tools/kimi_k3.py), then the message's close:

    ...thinking<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|>
    <|open|>tools<|sep|>...<|close|>tools<|sep|><|close|>message<|sep|>

The chat template's generation prompt opens the thinking (or, with thinking off, the response),
so a reply starts inside a section. The reasoning parser's name is kimi_k3. max_thinking_tokens
ends the thinking as the model would and opens the response; an output format applies to the
response's text.
"""

from app.engine import ThinkingBudget
from app.server.formats import after
from app.server.tools.base import partial_tag
from app.server.tools.keyed import KeyedParser
from app.server.tools.kimi_k3 import CLOSE, OPEN, KimiK3, close_tag, open_tag

END_OF_MESSAGE = "<|end_of_msg|>"
THINK, THOUGHT = open_tag("think"), close_tag("think")
RESPONSE, RESPONDED = open_tag("response"), close_tag("response")
TOOLS = open_tag("tools")
DONE = close_tag("message")
SECTIONS = {RESPONSE: "response", TOOLS: "call", DONE: "done"}  # the state each opens


def writes_xtml(template: str) -> bool:
    """Whether a chat template writes XTML (Kimi K3's does)."""
    return all(mark in template for mark in (OPEN, CLOSE, END_OF_MESSAGE))


def opened(tokenizer, prompt: list[int]) -> str:
    """The section the prompt ends inside: "think", "response", or "" (none)."""
    tail = tokenizer.decode(prompt[-32:], skip_special_tokens=False)
    return next((name for tag, name in ((THINK, "think"), (RESPONSE, "response")) if tail.endswith(tag)), "")


def budget(tokenizer, prompt: list[int], max_thinking_tokens: int) -> ThinkingBudget:
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    start = () if opened(tokenizer, prompt) == "think" else ids(THINK)
    return ThinkingBudget(ids(THOUGHT + RESPONSE), max_thinking_tokens, start)


def after_thought(tokenizer, grammar: str, section: str, tools: bool = False) -> str:
    """An output format or the tools' grammar (tools: it closes the response itself), for the
    response only: the thinking the prompt opened (section) comes first, free. Where XTML's
    marks are text, the grammar as it is."""
    fmt = KimiK3(tokenizer)
    if not fmt.opens_with_token(THOUGHT):
        return grammar
    m = fmt.marker
    head = {"think": f"THOUGHT {m(THOUGHT)} {m(RESPONSE)} ", "response": ""}.get(section, f"({m(RESPONSE)})? ")
    tail = "" if tools else f" ({m(RESPONDED)} ({m(DONE)})?)?"
    return after(f"start: {head}@answer{tail}\nTHOUGHT: /(.|\\n)*/\n", grammar)


class XtmlReply(KeyedParser):
    """A reply's sections out of streamed text: the thinking as reasoning (taken by
    take_reasoning), the response as content, the tools section's calls (streamed a parameter
    at a time, as KeyedParser streams them). Text outside any section is content; what follows
    the message's close is dropped."""

    after_block = "between"

    def __init__(self, section: str, fmt: KimiK3, properties: dict[str, dict]):
        super().__init__(fmt, properties)
        self.state, self.reasoning = section or "between", ""

    def step(self) -> bool:
        if self.state == "think":
            return self.until(THOUGHT, "reasoning")
        if self.state == "response":
            return self.until(RESPONDED, "content")
        if self.state == "done":
            self.pending = ""
            return False
        if self.state != "between":
            return super().step()  # in the tools section
        rest = self.pending.lstrip()
        tag = next((tag for tag in SECTIONS if rest.startswith(tag)), None)
        if tag:
            self.pending, self.state, self.opened = rest[len(tag):], SECTIONS[tag], 0
            return True
        if any(tag.startswith(rest) for tag in SECTIONS):
            return False  # maybe a tag, not whole yet
        self.state = "response"  # text outside the sections: content all the same
        return True

    def until(self, tag: str, into: str) -> bool:
        """The section's text up to tag (or up to a tools section: a model may call without
        closing its section), into reasoning or content; a partial tag held."""
        found = [(at, end) for end in (tag, TOOLS) if (at := self.pending.find(end)) >= 0]
        if not found:
            cut = len(self.pending) - max(partial_tag(self.pending, end) for end in (tag, TOOLS))
            setattr(self, into, getattr(self, into) + self.pending[:cut])
            self.pending = self.pending[cut:]
            return False
        at, end = min(found)
        setattr(self, into, getattr(self, into) + self.pending[:at])
        self.pending = self.pending[at + len(end):] if end == tag else self.pending[at:]
        self.state = "between"
        return True

    def take_reasoning(self) -> str:
        out, self.reasoning = self.reasoning, ""
        return out

    def finish(self) -> str:
        if self.state == "think":
            self.reasoning, self.pending = self.reasoning + self.pending, ""
            return ""
        if self.state in ("between", "response", "done"):
            rest, self.pending = self.pending, ""
            return "" if self.state == "done" else rest
        return super().finish()
