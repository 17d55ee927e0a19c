"""Each tool-call format without a server: its parser over text fed in random pieces (streamed
= whole), its grammars checked against llguidance on a tiny tokenizer with the format's markers,
the calls it writes into a prompt, and the format read from a chat template's source."""

import json
import random

import pytest
from tool_format_models import MODELS, make_format_model

from app.engine.grammar import Grammars
from app.server.schemas import ChatCompletionRequest
from app.server.tools import FORMATS, ToolUse, detect, prompt_messages
from app.server.tools.blocks import BlockFormat
from app.server.tools.keyed import KeyedFormat
from app.server.tools.mistral import Mistral
from model.tokenizer import IncrementalDetokenizer, Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                  "days": {"type": "integer"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALLS = [("get_weather", {"city": 'Par}is "x" <b>', "unit": "c", "days": 3}), ("get_time", {})]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.fixture(scope="module", params=list(MODELS))
def tokenizer(request, tmp_path_factory):
    """The tokenizer of a tiny model whose template writes one format."""
    return Tokenizer(make_format_model(request.param, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def fmt(tokenizer):
    return FORMATS[detect(tokenizer.chat_template_source)](tokenizer)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def use(fmt, **fields) -> ToolUse:
    return ToolUse.of(request(tools=[WEATHER, CLOCK], **fields), fmt)


def streamed(parser, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(content, the chunks, the calls) from feeding the pieces one by one."""
    content, chunks = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, chunks = content + text, chunks + new
    return content + parser.finish(), chunks, parser.calls


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30))) if seed else list(range(1, len(text)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def leading_text(fmt) -> str:
    return "" if fmt.name == "llama3_json" else "Let me check. "  # Llama's calls open the reply


@pytest.mark.parametrize("seed", range(12))
def test_any_split_of_the_calls_gives_what_the_whole_text_gives(fmt, seed):
    text = leading_text(fmt) + fmt.write_calls(CALLS)
    content, chunks, calls = streamed(use(fmt).parser(), random_pieces(text, seed))
    assert content.strip() == leading_text(fmt).strip()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    for index, call in enumerate(calls):  # the chunks add up to each call, as a client assembles them
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["id"] == call["id"] and mine[0]["function"]["name"] == call["function"]["name"]
        assert all("id" not in c and "name" not in c["function"] for c in mine[1:])
        assert "".join(c["function"]["arguments"] for c in mine) == call["function"]["arguments"]


def test_arguments_stream_before_the_call_ends(fmt):
    """Except a block format's that is not keyed (blocks.py, keyed.py): its calls come whole
    when the block ends."""
    text = fmt.write_calls(CALLS[:1])
    parser = use(fmt).parser()
    _, chunks = parser.feed(text[:text.index("unit")])
    if isinstance(fmt, BlockFormat) and not isinstance(fmt, KeyedFormat):
        assert not chunks
        _, chunks = parser.feed(text[text.index("unit"):])
        assert [c["function"]["name"] for c in chunks] == ["get_weather"]
        assert json.loads(chunks[0]["function"]["arguments"]) == CALLS[0][1]
        return
    assert chunks and chunks[0]["function"]["name"] == "get_weather"
    assert "city" in "".join(c["function"].get("arguments", "") for c in chunks)


@pytest.mark.parametrize("text", ["It is sunny in Rome.", "x < y and <tool", "Use [TOOL or <｜tool"])
def test_text_without_calls_stays_content(fmt, text):
    for pieces in ([text], list(text)):
        assert streamed(use(fmt).parser(), pieces)[:2] == (text, [])


def test_a_call_cut_off_before_its_name_is_given_back_as_content(fmt):
    opened = fmt.write_calls(CALLS[:1])
    cut = opened[:opened.index("get_weather")]
    content, chunks, _ = streamed(use(fmt).parser(), [cut])
    assert not chunks and (content == cut or cut.startswith(content) and content.strip())


def accepts(grammars, grammar: str, text: str) -> bool:
    """Whether the grammar takes the whole text and may end there."""
    matcher = grammars.matcher(grammar)
    ids = grammars.tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_template_names_its_format(tokenizer, fmt):
    assert fmt.name in MODELS and tokenizer.template_takes_tools
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None  # ChatML: the default


def test_required_takes_only_valid_calls(fmt, grammars):
    grammar = use(fmt, tool_choice="required").grammar()
    assert accepts(grammars, grammar, fmt.write_calls(CALLS))
    assert accepts(grammars, grammar, fmt.write_calls([("get_weather", {"city": "Rome"})]))
    assert not accepts(grammars, grammar, "Sure! " + fmt.write_calls(CALLS[:1]))
    assert not accepts(grammars, grammar, fmt.write_calls([("get_weather", {"town": "Rome"})]))
    assert not accepts(grammars, grammar, fmt.write_calls([("get_weather", {"city": "Rome", "unit": "k"})]))
    assert not accepts(grammars, grammar, fmt.write_calls([("get_weather", {"city": "Rome", "days": "x"})]))
    assert not accepts(grammars, grammar, fmt.write_calls([("get_time", {"x": 1})]))
    single = use(fmt, tool_choice="required", parallel_tool_calls=False).grammar()
    assert accepts(grammars, single, fmt.write_calls(CALLS[1:]))
    assert not accepts(grammars, single, fmt.write_calls(CALLS))


def test_a_named_function_takes_only_that_function(fmt, grammars):
    grammar = use(fmt, tool_choice={"type": "function", "function": {"name": "get_time"}}).grammar()
    assert accepts(grammars, grammar, fmt.write_calls([("get_time", {})]))
    assert not accepts(grammars, grammar, fmt.write_calls([("get_weather", {"city": "Rome"})]))


def test_auto_takes_text_and_holds_calls_once_they_open(fmt, grammars):
    grammar = use(fmt).grammar()
    assert accepts(grammars, grammar, "It is sunny in Rome, I think.")
    assert accepts(grammars, grammar, leading_text(fmt) + fmt.write_calls(CALLS))
    assert not accepts(grammars, grammar, leading_text(fmt) + fmt.write_calls([("get_weather", {"place": "Rome"})]))


def test_a_template_without_tools_gets_calls_and_results_as_the_format_writes_them(fmt):
    history = [{"role": "user", "content": "Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, extra = prompt_messages(history, use(fmt), False)
    assert extra == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and fmt.write_calls([("f", {})])[:5] in messages[0]["content"]
    assert messages[2]["content"] == fmt.write_calls([("get_weather", {"city": "Rome"})])
    assert messages[3]["content"] == fmt.write_result("sunny")
    assert prompt_messages(history, None, False, fmt)[0] == messages[1:]  # no tools: the server's format


def test_mistrals_newer_form_names_each_call_before_its_arguments(tmp_path):
    tokenizer = Tokenizer(make_format_model("mistral", tmp_path))
    fmt = Mistral(tokenizer, args_marker=True)
    text = fmt.write_calls(CALLS)
    assert text.startswith('[TOOL_CALLS]get_weather[ARGS]{"city"')
    for seed in range(6):
        content, _, calls = streamed(use(fmt).parser(), random_pieces("Sure. " + text, seed))
        assert content == "Sure. "
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    grammars = Grammars(tokenizer)
    assert accepts(grammars, use(fmt, tool_choice="required").grammar(), text)
    assert not accepts(grammars, use(fmt, tool_choice="required").grammar(), fmt.write_calls([("get_time", {"x": 1})]))


def detokenized(tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    return "".join(detok.add(i) for i in ids) + detok.flush()


@pytest.mark.parametrize("name", list(MODELS))
def test_markers_that_are_special_tokens_stay_in_the_text(name, tmp_path):
    """A real Mistral's [TOOL_CALLS] is a control token, which decoding skips: the server keeps
    the format's markers in the text (keep_in_text), so the parser sees the calls, and still
    drops the other special tokens."""
    path = make_format_model(name, tmp_path)
    spec = json.loads((path / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["special"] = token["special"] or token["content"] in MODELS[name][0]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer(path)
    fmt = FORMATS[name](tokenizer)
    written = fmt.write_calls(CALLS[:1])
    ids = tokenizer.encode(written + "<|im_end|>", add_special_tokens=False)
    assert fmt.opener not in detokenized(tokenizer, ids)  # what the parser saw before
    tokenizer.keep_in_text(fmt.marker_ids())
    assert detokenized(tokenizer, ids) == written
    content, _, calls = streamed(fmt.parser(use(fmt)), [detokenized(tokenizer, ids)])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS[:1]
