"""MiniMax M3's calls and thinking: nested objects and lists written as tags (as the real chat
template writes them) read back typed by the schema, the grammar that holds them, and the
thinking that a bare </mm:think> says is empty."""

import json

import pytest
from llama_cpp_source import chat_template
from tiny_model import make_tiny_model

from app.engine.grammar import Grammars
from app.server.reasoning import ReasoningParser, after_thinking
from app.server.schemas import ChatCompletionRequest
from app.server.tools import ToolUse, detect
from app.server.tools.minimax_m3 import NS, MiniMaxM3
from model.tokenizer import Tokenizer

PLAN = {"type": "function", "function": {"name": "plan_trip", "parameters": {
    "type": "object", "required": ["city", "stops"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "ref": {"type": "integer"},
                   "flexible": {"type": "boolean"}, "note": {"type": "string"},
                   "stops": {"type": "array", "items": {"type": "object", "properties": {
                       "name": {"type": "string"}, "hours": {"type": "number"}}}},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "budget": {"type": "object", "properties": {"max": {"type": "number"}, "currency": {"type": "string"}}}}}}}
NESTED = ("plan_trip", {"city": "Paris <3 & co", "days": 3, "ref": -14, "flexible": False, "note": "",
                        "stops": [{"name": "Louvre", "hours": 2.5}, {"name": "Orsay", "hours": 1}],
                        "tags": ["art", "42"], "budget": {"max": 900.0, "currency": "EUR"}})
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """MiniMax M3's template over a tiny vocabulary with its namespace mark and think tags as tokens."""
    path = make_tiny_model(tmp_path_factory.mktemp("minimax_m3"), tokens=(NS, "<mm:think>", "</mm:think>"),
                           chat_template=chat_template("MiniMax-M3"))
    return Tokenizer(path)


def use(fmt, **fields) -> ToolUse:
    return ToolUse.of(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [PLAN, CLOCK], **fields}), fmt)


def calls_in(fmt, text: str, step: int) -> tuple[str, list]:
    parser = use(fmt).parser()
    content = "".join(parser.feed(text[i:i + step])[0] for i in range(0, len(text), step)) + parser.finish()
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_nested_arguments_come_back_typed(step):
    fmt = MiniMaxM3()
    written = fmt.write_calls([NESTED, ("get_time", {})])
    assert f"{NS}<stops>{NS}<item>{NS}<name>Louvre{NS}</name>" in written and "null" not in written
    assert calls_in(fmt, "Let me plan. " + written, step) == ("Let me plan. ", [NESTED, ("get_time", {})])


def test_the_templates_own_tags_read_back(tok):
    """The call as the real template's to_xml writes it, a null left out."""
    arguments = {**NESTED[1], "budget": {**NESTED[1]["budget"], "currency": None}}
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "plan_trip", "arguments": arguments}}]}
    text = tok.render_chat([{"role": "user", "content": "Plan it."}, message], add_generation_prompt=False)
    assert detect(tok.chat_template_source) == "minimax_m3"
    fmt = MiniMaxM3(tok)
    expected = {**NESTED[1], "budget": {"max": 900.0}}
    assert calls_in(fmt, text[text.index(fmt.opener):], 9)[1] == [("plan_trip", expected)]


def accepts(grammars, grammar: str, text: str) -> bool:
    matcher = grammars.matcher(grammar)
    ids = grammars.tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_grammar_holds_nested_values_to_the_schema(tok):
    fmt, grammars = MiniMaxM3(tok), Grammars(tok)
    required = use(fmt, tool_choice="required").grammar()
    assert accepts(grammars, required, fmt.write_calls([NESTED]))
    wrong = {**NESTED[1], "stops": [{"name": "Louvre", "hours": "two"}]}
    assert not accepts(grammars, required, fmt.write_calls([("plan_trip", wrong)]))
    assert not accepts(grammars, required, fmt.write_calls([("plan_trip", {**NESTED[1], "budget": {"max": "x"}})]))
    assert not accepts(grammars, required, fmt.write_calls([("plan_trip", {"city": "Rome"})]))  # stops required
    auto = after_thinking(tok, use(fmt).grammar(), inside=False)
    assert accepts(grammars, auto, "<mm:think>Plan it.</mm:think>Sure. " + fmt.write_calls([NESTED]))
    assert accepts(grammars, auto, "</mm:think>Just text.")


@pytest.mark.parametrize("text, expected", [
    ("</mm:think>Hello, world!\nWhat's up?", ("", "Hello, world!\nWhat's up?")),
    ("<mm:think>I'm\nthinking</mm:think>Hello, world!", ("I'm\nthinking", "Hello, world!")),
    ("Plain answer, no tags.", ("", "Plain answer, no tags.")),
    ("</mm", ("", "</mm")),
])
def test_a_bare_closing_tag_is_an_empty_thought(text, expected):
    for step in (1, 3, len(text)):
        parser, reasoning, content = ReasoningParser(False, ("<mm:think>", "</mm:think>")), "", ""
        for i in range(0, len(text), step):
            r, c = parser.feed(text[i:i + step])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == expected
