"""Tool calling without a model: reading calls out of streamed text, the prompt a template gets,
and the grammar each tool_choice compiles to (checked against llguidance on a tiny tokenizer)."""

import json
import random

import pytest

from app.engine.grammar import Grammars
from app.server.errors import APIError
from app.server.schemas import ChatCompletionRequest
from app.server.tools import ToolCallParser, ToolUse, prompt_messages
from model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}is \\"x\\"", "unit": "c"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def split_calls(text: str) -> tuple[str, list[dict]]:
    """A whole text's content, and the calls it made."""
    content, _, calls = streamed([text])
    return content, calls


def streamed(pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(content, the chunks, the calls) from feeding the pieces one by one."""
    parser, content, chunks = ToolCallParser(), "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, chunks = content + text, chunks + new
    return content + parser.finish(), chunks, parser.calls


def test_the_whole_text_gives_content_and_both_calls():
    content, calls = split_calls(TEXT)
    assert content == "Let me check. \n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Par}is "x"', "unit": "c"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_stream_gives_what_the_whole_text_gives(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 40))) if seed else list(range(1, len(TEXT)))
    pieces = [TEXT[a:b] for a, b in zip([0] + cuts, cuts + [len(TEXT)])]
    content, chunks, calls = streamed(pieces)
    whole_content, whole_calls = split_calls(TEXT)
    assert content == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    for index, call in enumerate(calls):  # the chunks add up to each call, as a client assembles them
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["id"] == call["id"] and mine[0]["function"]["name"] == call["function"]["name"]
        assert all("id" not in c and "name" not in c["function"] for c in mine[1:])
        assert "".join(c["function"]["arguments"] for c in mine) == call["function"]["arguments"]


def test_a_partial_open_tag_is_held_back_and_released_at_the_end():
    parser = ToolCallParser()
    assert parser.feed("a <tool_c") == ("a ", [])
    assert parser.finish() == "<tool_c"
    assert split_calls("x < y and <tool") == ("x < y and <tool", [])


def test_arguments_before_the_name_come_out_whole_when_the_block_closes():
    text = '<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>'
    content, chunks, calls = streamed(list(text))
    assert content == "" and len(chunks) == 1
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": [1, 2]}'}


def test_a_block_that_is_not_a_call_stays_content():
    for text in ["<tool_call>not json</tool_call> ok", '<tool_call>{"arguments": 1}</tool_call>']:
        assert split_calls(text) == (text, [])
    assert split_calls("<tool_call>\n{\"na") == ("<tool_call>\n{\"na", [])  # cut off before the name


def test_tool_choice_is_read_as_openai_and_vllm_do():
    assert ToolUse.of(request()) is None
    assert ToolUse.of(request(tools=[WEATHER], tool_choice="none")) is None
    auto = ToolUse.of(request(tools=[WEATHER, CLOCK]))
    assert auto.choice == "auto" and auto.parallel and [f["name"] for f in auto.functions] == ["get_weather", "get_time"]
    named = ToolUse.of(request(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (named.choice, named.named, named.parallel) == ("named", "get_time", False)
    assert named.finish_reason("stop", True) == "stop" and auto.finish_reason("stop", True) == "tool_calls"
    assert auto.finish_reason("length", True) == "length" and auto.finish_reason("stop", False) == "stop"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_a_tool_choice_that_cannot_be_met_is_a_400(fields, param):
    with pytest.raises(APIError) as e:
        ToolUse.of(request(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_a_template_without_tools_gets_them_in_a_system_block_and_calls_as_text(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert not tok.template_takes_tools
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, extra = prompt_messages(history, ToolUse.of(request(tools=[WEATHER])), False)
    assert extra == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    prompt = tok.decode(tok.encode_chat(messages), skip_special_tokens=False)
    assert "<tools>" in prompt and "<tool_response>" in prompt
    assert prompt_messages(history[1:2], None, False) == (history[1:2], {})  # no tools, nothing added


def test_a_template_with_tools_gets_them_as_transformers_passes_them():
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    messages, extra = prompt_messages(history, ToolUse.of(request(tools=[CLOCK])), True)
    assert extra == {"tools": [{"type": "function", "function": {"name": "get_time"}}]}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(APIError):
        prompt_messages([{**history[0], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], None, True)


@pytest.fixture(scope="module")
def grammars(tiny_dir):
    return Grammars(Tokenizer(tiny_dir))


def accepts(grammars, grammar: str, text: str) -> bool:
    """Whether the grammar takes the whole text and may end there."""
    matcher = grammars.matcher(grammar)
    ids = grammars.tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_required_takes_only_valid_calls(grammars):
    grammar = ToolUse.of(request(tools=[WEATHER, CLOCK], tool_choice="required")).grammar()
    assert accepts(grammars, grammar, call("get_weather", {"city": "Rome"}))
    assert accepts(grammars, grammar, call("get_time", {}) + "\n" + call("get_weather", {"city": "Rome", "unit": "f"}))
    assert not accepts(grammars, grammar, "Sure! " + call("get_time", {}))
    assert not accepts(grammars, grammar, call("get_weather", {"town": "Rome"}))
    assert not accepts(grammars, grammar, call("get_weather", {"city": "Rome", "unit": "k"}))
    assert not accepts(grammars, grammar, call("get_time", {"x": 1}))
    single = ToolUse.of(request(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)).grammar()
    assert not accepts(grammars, single, call("get_time", {}) + "\n" + call("get_time", {}))


def test_a_named_function_takes_only_that_function(grammars):
    grammar = ToolUse.of(request(tools=[WEATHER, CLOCK],
                                 tool_choice={"type": "function", "function": {"name": "get_time"}})).grammar()
    assert accepts(grammars, grammar, call("get_time", {}))
    assert not accepts(grammars, grammar, call("get_weather", {"city": "Rome"}))


def test_auto_takes_text_and_holds_a_call_once_it_is_opened(grammars):
    grammar = ToolUse.of(request(tools=[WEATHER])).grammar()
    assert accepts(grammars, grammar, "It is sunny in Rome, I think.")
    assert accepts(grammars, grammar, "Let me look. " + call("get_weather", {"city": "Rome"}))
    assert not accepts(grammars, grammar, "Let me look. " + call("get_weather", {"place": "Rome"}))
    assert not accepts(grammars, grammar, "<tool_call>\nnot json")


def test_a_parameters_schema_llguidance_cannot_read_does_not_compile(grammars):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/nowhere"}}}
    with pytest.raises(ValueError, match="nowhere"):  # the server's 400: tests/test_tool_calling.py
        grammars.pristine(ToolUse.of(request(tools=[bad], tool_choice="required")).grammar())


def test_a_template_that_knows_tools_renders_them_itself(tiny_dir, tmp_path):
    import shutil

    from app.server.prompts import chat_prompt

    model = shutil.copytree(tiny_dir, tmp_path / "tools-template")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}call {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
        "{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    assert tok.template_takes_tools
    req = request(tools=[WEATHER, CLOCK], messages=[
        {"role": "user", "content": "Rome?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = tok.decode(chat_prompt(tok, req.messages, ToolUse.of(req), True), skip_special_tokens=False)
    assert text == '[tools: get_weather get_time]<user>Rome?<assistant>call get_weather {"city": "Rome"}<tool>sunny'
