"""GPT-OSS's harmony replies, without a model: the analysis channel comes back as
reasoning_content and the final channel as content, however the text is cut into deltas; a call
after the analysis is a tool call; a conversation goes through the real chat template, earlier
reasoning back as the template's `thinking`; and max_thinking_tokens forces the answer's header
through the engine's own rule, unless the model closed the analysis itself."""

import json
from types import SimpleNamespace

import pytest
from llama_cpp_source import chat_template
from tiny_model import make_tiny_model

from app.engine.outputs import OutputProcessor
from app.server import harmony
from app.server.chat_text import ChatText, Reading
from app.server.prompts import chat_prompt
from app.server.reasoning import HARMONY, detect
from app.server.schemas import ChatCompletionRequest
from app.server.tools import FORMATS, ToolUse
from model.tokenizer import Tokenizer

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
THOUGHT, ANSWER = "The user wants the weather. Ask get_weather.", "It is sunny, 21 C."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
REPLY = f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """GPT-OSS's template over a tiny vocabulary with harmony's markers as tokens."""
    path = make_tiny_model(tmp_path_factory.mktemp("harmony"), tokens=MARKERS,
                           chat_template=chat_template("openai-gpt-oss-120b"))
    return Tokenizer(path)


def tools(tok, **fields) -> ToolUse:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "tools": [WEATHER], **fields})
    return ToolUse.of(req, FORMATS["openai"](tok))


def read(pieces: list[str], use: ToolUse | None = None) -> tuple[str, str, list, str]:
    """(reasoning, content, calls, finish reason) as a chat reply streams them."""
    text, reasoning, content = ChatText(Reading(use, harmony=True)), "", ""
    for i, piece in enumerate(pieces):
        r, c, _ = text.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert text.thinks
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in text.tool_calls]
    return reasoning, content, calls, text.finish_reason("stop")


def splits(text: str) -> list[list[str]]:
    """The text whole, in every two pieces, and a character at a time: markers cut every way."""
    return [[text], *([text[:cut], text[cut:]] for cut in range(1, len(text))), list(text)]


def test_the_template_and_vocabulary_are_read_as_harmony(tok):
    assert detect(tok) == HARMONY
    assert {tok.hf.token_to_id("<|return|>"), tok.hf.token_to_id("<|call|>")} <= tok.eos_token_ids
    assert tok.hf.token_to_id("<|end|>") not in tok.eos_token_ids  # it ends the analysis, not the reply


@pytest.mark.parametrize("text, expected", [
    (REPLY, (THOUGHT, ANSWER)),
    (REPLY.removesuffix("<|return|>"), (THOUGHT, ANSWER)),  # the end token left out of the text
    ("<|channel|>analysis<|message|>still thinking <|en", ("still thinking <|en", "")),  # cut off thinking
    (f"{ANALYSIS}<|start|>assist", (THOUGHT, "")),  # cut off in the answer's header
    ("<|channel|>final<|message|>At once.", ("", "At once.")),
    ("Plain text, no harmony.", ("", "Plain text, no harmony.")),
])
def test_every_split_of_the_reply_gives_the_same_reasoning_and_content(text, expected):
    for pieces in splits(text):
        assert read(pieces)[:2] == expected, pieces


def test_a_call_after_the_analysis_is_reasoning_and_a_tool_call(tok):
    for pieces in splits(ANALYSIS + CALL):
        assert read(pieces, tools(tok)) == (THOUGHT, "", [("get_weather", {"city": "Paris"})], "tool_calls"), pieces
    assert read([ANALYSIS + CALL])[1:] == ("", [], "stop")  # no tools offered: no call read


def test_the_conversation_goes_through_the_template_with_its_thinking(tok):
    """An assistant's reasoning_content reaches the template as its `thinking`: written as the
    analysis before a call, dropped for an earlier answer (as the template does)."""
    call = {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = ChatCompletionRequest.model_validate({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"}]})
    fmt = FORMATS["openai"](tok)
    prompt = tok.decode(chat_prompt(tok, req.messages, ToolUse.of(req, fmt), True, req.template_variables(), fmt),
                        skip_special_tokens=False)
    assert f"<|start|>assistant{ANALYSIS}<|start|>assistant to=functions.get_weather" in prompt
    assert "A greeting." not in prompt and "<|channel|>final<|message|>Hi!<|end|>" in prompt
    assert prompt.endswith("<|start|>assistant")  # the reply's first message is the model's to open
    assert read([REPLY]) == (THOUGHT, ANSWER, [], "stop")


def budgeted(tok, model: str, max_tokens: int) -> str:
    """What the output becomes under the budget: the model's tokens, but where the engine forces one."""
    budget = harmony.budget(tok, max_tokens)
    script = tok.encode(model, add_special_tokens=False)
    request = SimpleNamespace(params=SimpleNamespace(thinking=budget), output_ids=[],
                              output=SimpleNamespace(thought=False))
    while script:
        forced = OutputProcessor.thinking_end(request)
        request.output_ids.append(script.pop(0) if forced is None else forced)
    return tok.decode(request.output_ids, skip_special_tokens=False)


def test_the_budget_ends_the_analysis_and_opens_the_answer(tok):
    header, thought = "<|channel|>analysis<|message|>", "hmm " * 40
    ids = tok.encode(header + thought, add_special_tokens=False)
    out = budgeted(tok, header + thought, 5)
    cut = tok.decode(ids[:len(tok.encode(header, add_special_tokens=False)) + 5], skip_special_tokens=False)
    assert out.startswith(cut + "<|end|><|start|>assistant<|channel|>final<|message|>")
    reasoning, content, _, _ = read([out])
    assert reasoning == cut.removeprefix(header) and content


def test_an_analysis_the_model_closes_itself_is_left_alone(tok):
    """Its <|end|> within the budget ends the thinking: a call of any length may follow."""
    short = "<|channel|>analysis<|message|>Ask.<|end|>"
    assert budgeted(tok, short + CALL, 8) == short + CALL
    answer = "<|channel|>final<|message|>" + "An answer at once, with no analysis at all. " * 3
    assert budgeted(tok, answer, 4) == answer
