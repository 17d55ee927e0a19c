"""GPT-OSS's thinking, in OpenAI's harmony format: a reply is messages, each on a channel, and
the analysis channel's text is the reasoning (vLLM's parser name: openai_gptoss):

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

The chat template's generation prompt opens the reply's first message (`<|start|>assistant`).
The messages are read by the openai tool-call format's parser (app/server/tools/openai.py),
which gives the analysis channel as reasoning, the final channel (and a commentary message to no
one, a preamble) as content, and a commentary message to a function as a call. max_thinking_tokens ends the analysis as the model would
and opens the answer: the engine forces `<|end|><|start|>assistant<|channel|>final<|message|>`
(a call's header, up to `to=functions.`, where tool_choice asks for calls), unless the model
closed the analysis itself (its <|end|>), maybe to call a tool. An output format applies to
the final channel's text, after the analysis; a tool grammar is the openai format's own.
"""

from app.engine import ThinkingBudget
from app.server.formats import after
from app.server.tools.openai import CHANNEL, END, MESSAGE, OPEN, START, OpenAI

ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
ANSWER = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
CALLS = f"{END}{START}assistant{CHANNEL}commentary {OPEN}"


def writes_analysis(template: str) -> bool:
    """Whether a chat template writes harmony's analysis channel (GPT-OSS's does)."""
    return ANALYSIS in template


def budget(tokenizer, max_thinking_tokens: int, calls_only: bool = False) -> ThinkingBudget:
    """calls_only: tool_choice required or named, whose grammar takes no final answer: the
    header forced is a call's."""
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    answer = CALLS if calls_only else ANSWER
    return ThinkingBudget(ids(answer), max_thinking_tokens, start_ids=ids(ANALYSIS), close_ids=ids(END))


def after_analysis(tokenizer, grammar: str) -> str:
    """The output format, for the final channel's text only: the analysis comes first, free."""
    fmt = OpenAI(tokenizer)
    return after(f'start: notes {fmt.marker(CHANNEL)} "final" {fmt.marker(MESSAGE)} @answer\n{fmt.notes()}\n', grammar)
