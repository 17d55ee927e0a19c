"""The block formats that write a call a parameter at a time (keyed.py: XML invocations, GLM's
keys and values) stream: a call opens at its name and its arguments grow as each parameter
closes; any split of the text gives what the whole gives; a block that is not calls stays
content, as it was when blocks were read whole."""

import json
import random

import pytest

from app.server.schemas import ChatCompletionRequest
from app.server.tools import FORMATS, ToolUse
from app.server.tools.keyed import KeyedFormat

KEYED = sorted(name for name, fmt in FORMATS.items() if issubclass(fmt, KeyedFormat))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALLS = [("get_weather", {"city": "Par}is \"x\" <b>", "days": 3, "tags": ["a", "b"]}), ("get_time", {})]


def use(fmt) -> ToolUse:
    return ToolUse.of(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, CLOCK]}), fmt)


def streamed(fmt, pieces: list[str]) -> tuple[str, list[dict], list]:
    parser = use(fmt).parser()
    content, chunks = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, chunks = content + text, chunks + new
    content += parser.finish()
    return content, chunks, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls]


def test_the_keyed_formats_are_those_that_write_a_parameter_at_a_time():
    assert {"minimax_m2", "deepseek_v32", "deepseek_v4", "glimmer", "minicpm", "glm45", "glm47", "gemma4"} <= set(KEYED)


@pytest.mark.parametrize("name", KEYED)
@pytest.mark.parametrize("seed", range(8))
def test_any_split_gives_what_the_whole_text_gives(name, seed):
    fmt = FORMATS[name]()
    text = "Let me check. " + fmt.write_calls(CALLS) + " Done."
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40))) if seed else list(range(1, len(text)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = streamed(fmt, [text])
    assert whole[0] == "Let me check.  Done." or whole[0].replace("\n", "") == "Let me check.  Done."
    assert whole[2] == CALLS
    got = streamed(fmt, pieces)
    assert (got[0], got[2]) == (whole[0], whole[2])


@pytest.mark.parametrize("name", KEYED)
def test_a_call_opens_at_its_name_and_its_arguments_grow_a_parameter_at_a_time(name):
    fmt = FORMATS[name]()
    text = fmt.write_calls(CALLS[:1])
    parser = use(fmt).parser()
    _, first = parser.feed(text[:text.index("Par}is")])
    assert [c["function"]["name"] for c in first if "id" in c] == ["get_weather"]
    _, more = parser.feed(text[text.index("Par}is"):text.index("tags")])
    written = "".join(c["function"].get("arguments", "") for c in first + more)
    assert written.startswith('{"city": "Par}is \\"x\\" <b>", "days": 3') and not written.endswith("}")
    _, rest = parser.feed(text[text.index("tags"):])
    arguments = written + "".join(c["function"].get("arguments", "") for c in rest)
    assert json.loads(arguments) == CALLS[0][1] and parser.finish() == ""


@pytest.mark.parametrize("name", KEYED)
def test_a_block_that_is_not_calls_and_a_call_cut_short_stay_content(name):
    fmt = FORMATS[name]()
    stray = fmt.opener + "not a call at all" + fmt.closer + " then text"
    assert streamed(fmt, list(stray))[::2] == (stray, [])
    cut = fmt.write_calls(CALLS[:1])
    cut = cut[:cut.index("get_weather")]
    assert streamed(fmt, [cut])[::2] == (cut, [])
