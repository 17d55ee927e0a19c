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

from app.engine.grammar import Grammars
from app.engine.outputs import OutputProcessor
from app.server import harmony
from app.server.chat_text import ChatText, Reading
from app.server.formats import json_grammar
from app.server.prompts import chat_prompt
from app.server.reasoning import HARMONY, detect
from app.server.schemas import ChatCompletionRequest
from app.server.tools import FORMATS, ToolUse
from app.server.tools.openai import HarmonyParser
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
    text, reasoning, content = ChatText(Reading(use, whole=HarmonyParser)), "", ""
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


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def budgeted(tok, model: list[int], max_tokens: int, calls_only: bool = False) -> list[int]:
    """The output under the budget: the model's tokens in turn, but where the engine forces one."""
    request = SimpleNamespace(params=SimpleNamespace(thinking=harmony.budget(tok, max_tokens, calls_only)),
                              output_ids=[], output=SimpleNamespace(thought=False))
    model = list(model)
    while model:
        forced = OutputProcessor.thinking_end(request)
        request.output_ids.append(model.pop(0) if forced is None else forced)
    return request.output_ids


def taken(tok, grammar: str, out: list[int]) -> bool:
    """Whether the grammar takes the output token by token, as the engine feeds it, to its end."""
    matcher = Grammars(tok).matcher(grammar)
    return all(matcher.consume_token(t) for t in out) and (matcher.is_accepting() or matcher.is_stopped())


HEADER, ARGUMENTS = "<|channel|>analysis<|message|>", 'get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'


@pytest.mark.parametrize("choice, then, expected", [
    ("auto", "It is sunny.<|return|>", ("It is sunny.", [])),
    ("required", ARGUMENTS, ("", [("get_weather", {"city": "Paris"})])),
    (None, '{"sky": "sunny"}<|return|>', ('{"sky": "sunny"}', [])),  # response_format
])
def test_the_budget_ends_the_analysis_with_what_the_grammar_takes(tok, choice, then, expected):
    """Five tokens thought, then the answer's header forced (a call's, where only calls may
    come), then the model's own answer: the grammar takes it all, and it reads back apart."""
    thought = ids(tok, "hmm " * 40)[:5]
    out = budgeted(tok, ids(tok, HEADER) + thought + ids(tok, then), 5, calls_only=choice == "required")
    forced = "<|channel|>final<|message|>" if choice != "required" else "<|channel|>commentary to=functions."
    assert tok.decode(out, skip_special_tokens=False) == (
        HEADER + tok.decode(thought) + "<|end|><|start|>assistant" + forced + then)
    use = tools(tok, tool_choice=choice) if choice else None
    grammar = use.grammar() if use else harmony.after_analysis(tok, json_grammar({"type": "object"}, "response_format"))
    assert taken(tok, grammar, out)
    reasoning, content, calls, _ = read([tok.decode(out, skip_special_tokens=False)], use)
    assert (reasoning, content, calls) == (tok.decode(thought), *expected)


def test_an_analysis_the_model_closes_itself_is_left_alone(tok):
    """Its <|end|> within the budget ends the thinking: a call of any length may follow."""
    short = ids(tok, "<|channel|>analysis<|message|>Ask.<|end|>" + CALL)
    assert budgeted(tok, short, 8) == short
    answer = ids(tok, "<|channel|>final<|message|>" + "An answer at once, with no analysis at all. " * 3)
    assert budgeted(tok, answer, 4) == answer


PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"


@pytest.mark.parametrize("choice, text, takes", [
    ("auto", ANALYSIS + CALL, True),
    ("auto", ANALYSIS + PREAMBLE + CALL, True),
    ("auto", REPLY, True),
    ("required", ANALYSIS + PREAMBLE + CALL, True),
    ("required", CALL.removeprefix("<|start|>assistant"), True),
    ("required", REPLY, False),
    ("auto", "Plain text, no harmony.", False),
])
def test_the_tools_grammar_takes_harmony_messages_before_a_call(tok, choice, text, takes):
    """Analysis and commentary to no one may come first (markers that are tokens of their own
    are never free text); auto may answer on the final channel instead, required may not."""
    assert taken(tok, tools(tok, tool_choice=choice).grammar(), ids(tok, text)) is takes


def test_a_preamble_is_content_before_the_calls(tok):
    """Commentary to no one (what the model says it will do) is content, as OpenAI's harmony
    guide shows preambles to the user; the calls after it, two in a row, are both read; a
    preamble before a final answer is set off from it by a blank line."""
    second = CALL.replace("Paris", "Rome")
    for pieces in splits(ANALYSIS + PREAMBLE + CALL + second):
        assert read(pieces, tools(tok, parallel_tool_calls=True)) == (
            THOUGHT, "Checking.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
            "tool_calls"), pieces
    assert read([ANALYSIS + PREAMBLE + REPLY.removeprefix(ANALYSIS)]) == (THOUGHT, "Checking.\n\n" + ANSWER, [], "stop")


def test_the_flag_takes_vllms_names_only():
    from app.cli import parse
    from app.serve import validate_flags

    _, args, _ = parse(["serve", "--reasoning-parser", "openai_gptoss"], environ={})
    validate_flags(args)
    args.reasoning_parser = "gptoss"
    with pytest.raises(ValueError, match="--reasoning-parser 'gptoss' is not one of deepseek_r1, qwen3, mistral, openai_gptoss"):
        validate_flags(args)
