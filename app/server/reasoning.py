"""A reasoning model's thinking, returned apart: `reasoning_content`, as vLLM names it.

How the served model writes its thinking is settled once at start-up: named by
--reasoning-parser (vLLM's names), else harmony's analysis channel where the chat template
writes one (GPT-OSS: app/server/harmony.py), else XTML's think section where it writes XTML
(Kimi K3: app/server/xtml.py), else <think> tags where the vocabulary has them.

A model thinks in tags when its vocabulary has `<think>` and `</think>` tokens (Qwen3,
DeepSeek-R1 and their kin), `[THINK]` and `[/THINK]` (Mistral's: Magistral, Ministral 3), or
`<mm:think>` and `</mm:think>` (MiniMax M3's; model/tokenizer.THINK_TAGS). The thinking is the
text from the start of the output (the chat template may have written the opening tag already)
or from an opening tag the output starts with, up to the closing one; an output that starts
with the closing tag thought nothing (MiniMax M3 writes one when it does not think).
max_thinking_tokens makes the engine write the closing tag once that many tokens were thought.
An output format or tool grammar applies to the answer after the thinking, as vLLM's does.
"""

import json
import re
from collections.abc import Callable
from functools import partial

from app.engine import ThinkingBudget
from app.server import harmony, xtml
from app.server.formats import after
from app.server.tools import partial_tag
from app.server.tools.base import CallStream, parameters
from app.server.tools.kimi_k3 import KimiK3
from app.server.tools.openai import HarmonyParser
from model.tokenizer import THINK_TAGS

THINK, HARMONY, XTML = "think", "harmony", "xtml"
# --reasoning-parser's names, as vLLM's (kimi_k3 is Spool's)
PARSERS = {"deepseek_r1": THINK, "qwen3": THINK, "mistral": THINK, "openai_gptoss": HARMONY, "kimi_k3": XTML}
WHOLE = {HARMONY: "openai", XTML: "kimi_k3"}  # the kinds read with the calls, by the tool format whose markers they use


def detect(tokenizer) -> str | None:
    """How the model writes its thinking (THINK, HARMONY or XTML), by its template and
    vocabulary; None: it does not think, or not in a way Spool reads."""
    if harmony.writes_analysis(tokenizer.chat_template_source):
        return HARMONY
    if xtml.writes_xtml(tokenizer.chat_template_source):
        return XTML
    return THINK if tokenizer.think_ids is not None else None


def whole_reader(kind: str | None, tokenizer, prompt: list[int], tools) -> Callable[[], CallStream] | None:
    """What reads each choice's whole reply, where the model writes its reasoning, content and
    calls as one structure (harmony, XTML); None where they are read apart."""
    if kind == HARMONY:
        return HarmonyParser
    if kind == XTML:
        properties = {f["name"]: parameters(f).get("properties", {}) for f in tools.functions} if tools else {}
        return partial(xtml.XtmlReply, xtml.opened(tokenizer, prompt), KimiK3(), properties)
    return None


def opens_thinking(tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt ends inside a thinking section (the template opened it)."""
    if tokenizer.think_ids is None:
        return False
    start, end = tokenizer.think_ids
    tail = prompt[-4:]  # <think> and a newline or two
    return start in tail and end not in tail[tail.index(start):]


def budget(kind: str | None, tokenizer, prompt: list[int], max_thinking_tokens: int | None,
           calls_only: bool = False) -> ThinkingBudget | None:
    """calls_only: the tools' grammar takes calls and nothing else (harmony's forced header is a call's)."""
    if kind is None or max_thinking_tokens is None:
        return None
    if kind == HARMONY:
        return harmony.budget(tokenizer, max_thinking_tokens, calls_only)
    if kind == XTML:
        return xtml.budget(tokenizer, prompt, max_thinking_tokens)
    start, end = tokenizer.think_ids
    return ThinkingBudget((end,), max_thinking_tokens, () if opens_thinking(tokenizer, prompt) else (start,))


def after_thinking(tokenizer, grammar: str, inside: bool) -> str:
    """The grammar, for the answer only: free thinking comes first (it is there already when
    inside; else the model may open it, or answer at once)."""
    start, end = tokenizer.think_ids
    if end in tokenizer.hf.get_added_tokens_decoder():  # llguidance keeps added tokens out of text
        open_tag, close_tag, body, rules = f"<[{start}]>", f"<[{end}]>", f"THOUGHT <[{end}]>", r"THOUGHT: /(.|\n)*/"
    else:
        opening, closing = tokenizer.think_tags
        open_tag, close_tag, body = json.dumps(opening), json.dumps(closing), "thought"
        rules = "thought[lazy]: /(.|\\n)*" + re.escape(closing).replace("/", "\\/") + "/"
    top = f"start: {body} @answer" if inside else f"start: {open_tag} {body} @answer | {close_tag} @answer | @answer"
    return after(f"{top}\n{rules}\n", grammar)


class ReasoningParser:
    """Splits one choice's text, as it streams, into reasoning and content."""

    def __init__(self, inside: bool, tags: tuple[str, str] = THINK_TAGS[0]):
        self.state = "thinking" if inside else "opening"  # opening: it may still start with the opening tag
        self.start, self.end = tags
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that text settles; a tag split across pieces is held."""
        self.pending += text
        reasoning = content = ""
        if self.state == "opening":
            head = self.pending.lstrip()
            if head.startswith(self.start):
                self.state, self.pending = "thinking", head[len(self.start):]
            elif head.startswith(self.end):  # thought nothing
                self.state, self.pending = "answering", head[len(self.end):]
            elif self.start.startswith(head) or self.end.startswith(head):
                return "", ""
            else:
                self.state = "answering"
        if self.state == "thinking":
            at = self.pending.find(self.end)
            if at < 0:
                keep = partial_tag(self.pending, self.end)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(self.end):]
            self.state = "answering"
        if self.state == "answering":
            content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "thinking" else ("", rest)
