"""Each tool-call format through the official openai client against a real server serving a
tiny random model whose chat template writes that format: forced calls (required, a named
function) parse and validate, streamed and not; auto, steered to open a call by a logit_bias
on the format's opening token, makes a call that validates, and without it stays text."""

import json

import jsonschema
import pytest
from live_server import LiveServer
from tool_format_models import MODELS, make_format_model

from app.server.tools import FORMATS
from model.tokenizer import Tokenizer

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 0, "maximum": 9}}}
TIME = {"type": "object", "additionalProperties": False, "properties": {}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    """(server, the id of the opener's first token) for one format's tiny model."""
    path = make_format_model(request.param, tmp_path_factory.mktemp(request.param))
    server = LiveServer("--model", str(path), "--served-model-name", "tiny", "--kv-cache-gib", "0.05", "--max-model-len", "1024")
    try:
        assert f"tool calls in the {request.param} format (from the chat template)" in server.output()
        opener = FORMATS[request.param].opener
        yield server, Tokenizer(path).encode(opener, add_special_tokens=False)[0]
    finally:
        server.stop()


def calls_of(client, stream: bool, **kwargs) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(finish_reason, content, [(name, arguments)]) of one choice, assembled from the stream
    the way a client does when stream is set."""
    kwargs = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 520, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return (choice.finish_reason, choice.message.content,
                [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []])
    reason, content, calls = None, None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for piece in choice.delta.tool_calls or []:
                if piece.id:
                    assert piece.index not in calls and piece.type == "function"
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            reason = choice.finish_reason or reason
    return reason, content, [tuple(c) for _, c in sorted(calls.items())]


def check(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_forced_calls_parse_and_validate(served, stream):
    server, _ = served
    client = server.openai_client()
    for seed in range(3):
        reason, content, calls = calls_of(client, stream, tool_choice="required", seed=seed,
                                          parallel_tool_calls=False)
        assert reason == "tool_calls" and not content, (reason, content, server.output()[-2000:])
        check(calls)
        reason, content, calls = calls_of(client, stream, seed=seed, parallel_tool_calls=False,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert reason == "stop" and not content and len(calls) == 1
        check(calls, names=("get_weather",))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_calls_when_steered_and_stays_text_when_not(served, stream):
    server, opener = served
    client = server.openai_client()
    for seed in range(2):
        reason, content, calls = calls_of(client, stream, seed=seed, parallel_tool_calls=False,
                                          logit_bias={str(opener): 100})
        assert reason == "tool_calls" and not (content or "").strip() and len(calls) == 1
        check(calls)
        reason, content, calls = calls_of(client, stream, seed=seed, max_tokens=12, logit_bias={str(opener): -100})
        assert content and not calls and reason in ("stop", "length")


def test_earlier_calls_and_results_go_through_the_template(served):
    server, _ = served
    client = server.openai_client()
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1)
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4, seed=0)
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 5


def test_the_flag_names_the_format_over_the_template(tmp_path):
    import subprocess
    import sys

    path = make_format_model("hermes", tmp_path / "hermes")
    server = LiveServer("--model", str(path), "--served-model-name", "tiny", "--kv-cache-gib", "0.05",
                        "--max-model-len", "1024", "--tool-call-parser", "llama3_json")
    try:
        assert "tool calls in the llama3_json format (from --tool-call-parser)" in server.output()
        reply = server.openai_client().chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=520, seed=0)
        check([(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls])
    finally:
        server.stop()
    proc = subprocess.run([sys.executable, "-m", "app", "serve", "--model", str(path), "--tool-call-parser", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    from app.server.tools import FORMATS

    assert proc.stderr.strip() == f"error: --tool-call-parser 'nope' is not one of {', '.join(FORMATS)}"
    assert len(FORMATS) > 25 and {"hermes", "mistral", "openai", "pythonic"} <= set(FORMATS)
