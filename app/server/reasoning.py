"""A reasoning model's thinking, returned apart: `reasoning_content`, as vLLM names it.

How the served model writes its thinking is settled once at start-up: named by
--reasoning-parser (vLLM's names), else harmony's analysis channel where the chat template
writes one (GPT-OSS: app/server/harmony.py), else <think> tags where the vocabulary has them.

A model thinks in tags when its vocabulary has `<think>` and `</think>` tokens (Qwen3,
DeepSeek-R1 and their kin). The thinking is the text from the start of the output (the chat
template may have written `<think>` already) or from a `<think>` the output opens with, up to
`</think>`. max_thinking_tokens makes the engine write `</think>` once that many tokens were
thought. An output format or tool grammar applies to the answer after the thinking, as vLLM's does.
"""

import json

from app.engine import ThinkingBudget
from app.server import harmony
from app.server.formats import after
from app.server.tools import partial_tag

START, END = "<think>", "</think>"
THINK, HARMONY = "think", "harmony"
PARSERS = {"deepseek_r1": THINK, "qwen3": THINK, "openai_gptoss": HARMONY}  # --reasoning-parser's names


def detect(tokenizer) -> str | None:
    """How the model writes its thinking (THINK or HARMONY), by its template and vocabulary;
    None: it does not think, or not in a way Spool reads."""
    if harmony.writes_analysis(tokenizer.chat_template_source):
        return HARMONY
    return THINK if tokenizer.think_ids is not None else None


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
    start, end = tokenizer.think_ids
    return ThinkingBudget((end,), max_thinking_tokens, () if opens_thinking(tokenizer, prompt) else (start,))


def after_thinking(tokenizer, grammar: str, inside: bool) -> str:
    """The grammar, for the answer only: free thinking comes first (it is there already when
    inside; else the model may open it, or answer at once)."""
    start, end = tokenizer.think_ids
    if end in tokenizer.hf.get_added_tokens_decoder():  # llguidance keeps added tokens out of text
        open_tag, body, rules = f"<[{start}]>", f"THOUGHT <[{end}]>", r"THOUGHT: /(.|\n)*/"
    else:
        open_tag, body, rules = json.dumps(START), "thought", r"thought[lazy]: /(.|\n)*<\/think>/"
    top = f"start: {body} @answer" if inside else f"start: {open_tag} {body} @answer | @answer"
    return after(f"{top}\n{rules}\n", grammar)


class ReasoningParser:
    """Splits one choice's text, as it streams, into reasoning and content."""

    def __init__(self, inside: bool):
        self.state = "thinking" if inside else "opening"  # opening: it may still start with <think>
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that text settles; a tag split across pieces is held."""
        self.pending += text
        reasoning = content = ""
        if self.state == "opening":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.state, self.pending = "thinking", head[len(START):]
            elif START.startswith(head):
                return "", ""
            else:
                self.state = "answering"
        if self.state == "thinking":
            at = self.pending.find(END)
            if at < 0:
                keep = partial_tag(self.pending, END)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(END):]
            self.state = "answering"
        if self.state == "answering":
            content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "thinking" else ("", rest)
