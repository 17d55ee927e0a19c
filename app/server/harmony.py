"""GPT-OSS's thinking, in OpenAI's harmony format: a reply is messages, each on a channel, and
the analysis channel's text is the reasoning (vLLM's parser name: openai_gptoss):

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

The chat template's generation prompt opens the reply's first message (`<|start|>assistant`).
The messages are read by the openai tool-call format's parser (app/server/tools/openai.py),
which gives the analysis channel as reasoning, the final channel as content, and a commentary
message to a function as a call. max_thinking_tokens ends the analysis as the model would and
opens the answer: the engine forces `<|end|><|start|>assistant<|channel|>final<|message|>`,
unless the model closes the analysis itself (its <|end|>), maybe to call a tool instead.
"""

from app.engine import ThinkingBudget
from app.server.tools.openai import CHANNEL, END, MESSAGE, START

ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
ANSWER = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"


def writes_analysis(template: str) -> bool:
    """Whether a chat template writes harmony's analysis channel (GPT-OSS's does)."""
    return ANALYSIS in template


def budget(tokenizer, max_thinking_tokens: int) -> ThinkingBudget:
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return ThinkingBudget(ids(ANSWER), max_thinking_tokens, start_ids=ids(ANALYSIS), close_ids=ids(END))
