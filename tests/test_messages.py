"""Anthropic's Messages API through the official `anthropic` client, on the default model served
with an API key (the client sends it as x-api-key): a plain message, a streamed one that
accumulates to the same message, forced tool use whose input validates, a tool_result round
trip, stop sequences, count_tokens, and errors in Anthropic's shape. Every body is checked
against the client's own types (generated from Anthropic's published API), with nothing extra.

A tiny reasoning model shows thinking blocks, streamed and not, and thinking disabled."""

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from app.server.anthropic.responder import block
from app.server.output_parts import OutputParts
from live_server import LiveServer
from tiny_model import THINKING_CHATML, make_tiny_model

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-messages"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "The local time in a city",
          "input_schema": {"type": "object", "required": ["city"], "additionalProperties": False,
                           "properties": {"city": {"type": "string", "maxLength": 30}}}}]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the client has no temperature argument any more; the API still takes one


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--kv-cache-gib", "0.25", "--max-seqs", "16", "--api-key", KEY)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


def check_message(body: dict) -> Message:
    """The body as the client's Message, with no field the type does not know."""
    message = Message.model_validate(body)
    assert set(body) <= set(Message.model_fields), set(body) - set(Message.model_fields)
    for block in body["content"]:
        assert set(block) == {"text": {"type", "text"}, "thinking": {"type", "thinking", "signature"},
                              "tool_use": {"type", "id", "name", "input"}}[block["type"]]
    return message


def post(server, body: dict, path: str = "/v1/messages", **headers) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": KEY, **headers}, timeout=120)


def test_a_plain_message(client, server):
    message = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, messages=ASK)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["text"] and "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens > 0
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == count(client, ASK)
    check_message(post(server, {"model": MODEL, "max_tokens": 20, "messages": ASK}).json())


def count(client, messages, **kwargs) -> int:
    return client.messages.count_tokens(model=MODEL, messages=messages, **kwargs).input_tokens


def test_a_streamed_message_accumulates_to_the_same_message(client):
    kwargs = dict(model=MODEL, max_tokens=40, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Write a short poem about the sea."}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert streamed.stop_reason == "max_tokens"
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and types[-2] == "message_delta"
    assert types.count("content_block_start") == types.count("content_block_stop") == 1
    assert types.count("content_block_delta") > 3  # the text came in pieces


def test_the_event_stream_follows_anthropics_types(server):
    """Each event's name and payload as the client's RawMessageStreamEvent, in order."""
    body = {"model": MODEL, "max_tokens": 12, "stream": True, "messages": ASK}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(payloads) and [p["type"] for p in payloads] == names
    adapter = TypeAdapter(RawMessageStreamEvent)
    for payload in payloads:
        if payload["type"] != "ping":
            adapter.validate_python(payload)
    check_message(payloads[0]["message"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "named"])
def test_forced_tool_use_validates_against_the_tools_schema(client, stream, choice):
    def ask(city: str) -> Message:
        kwargs = dict(model=MODEL, max_tokens=80, tools=TOOLS, tool_choice={**choice, "disable_parallel_tool_use": True},
                      messages=[{"role": "user", "content": f"What is the weather in {city}?"}])
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as s:
            return s.get_final_message()

    with ThreadPoolExecutor(4) as pool:
        messages = list(pool.map(ask, ["Paris", "Tokyo", "Lima", "Oslo"]))
    for message in messages:
        assert message.stop_reason == "tool_use"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].id.startswith("toolu_")
        assert uses[0].name == choice.get("name", uses[0].name)
        jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])


def test_a_tool_result_round_trip(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=80, tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"}, messages=asked)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    history = asked + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": "Sunny, 24 degrees celsius"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=40, tools=TOOLS, extra_body=GREEDY, messages=history)
    assert answer.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert answer.content
    # the result reached the prompt, as the chat template writes a tool message
    with_result = count(client, history, tools=TOOLS)
    without = count(client, history[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": ""}]}], tools=TOOLS)
    assert with_result > without


def test_stop_sequences_end_with_the_sequence(client):
    message = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=ASK, stop_sequences=["Paris"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"
    assert "Paris" not in message.content[0].text


def test_output_config_format_holds_the_text_to_the_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["capital"],
              "properties": {"capital": {"type": "string", "maxLength": 20}}}
    message = client.messages.create(model=MODEL, max_tokens=60, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_max_tokens_is_held_to_the_context(client):
    message = client.messages.create(model=MODEL, max_tokens=10**6, extra_body=GREEDY, messages=ASK)
    assert message.stop_reason == "end_turn"


def test_count_tokens_counts_the_tools_and_the_system(client):
    plain = count(client, ASK)
    system = "You answer in French, in one sentence, politely. " * 4  # longer than the template's default one
    assert count(client, ASK, system=system) > plain
    assert count(client, ASK, system=[{"type": "text", "text": system}]) == count(client, ASK, system=system)
    assert count(client, ASK, tools=TOOLS) > count(client, ASK, tools=TOOLS[:1]) > plain


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "image blocks are not supported"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "server tools"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "tool_choice"),
    ({"model": "claude-opus-4", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "claude-opus-4"),
])
def test_errors_come_in_anthropics_shape(server, body, status, kind, words):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error) == {"type", "error"}
    assert error["error"]["type"] == kind and words in error["error"]["message"], error


def test_the_key_is_taken_from_x_api_key_or_bearer(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    denied = post(server, body, **{"x-api-key": "wrong"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert httpx.post(server.url + "/v1/messages", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
    openai_shape = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=30)
    assert openai_shape.status_code == 401 and "message" in openai_shape.json()["error"]


def test_text_is_trimmed_and_calls_become_blocks_in_any_split():
    """The parts give the same blocks for the text fed whole or in pieces."""
    calls = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}},
             {"index": 0, "function": {"arguments": '{"a": '}}, {"index": 0, "function": {"arguments": "1}"}}]
    pieces = [("hm", "", []), (" ok", "\n ", []), ("", "Let me", []), ("", " look.\n", []), ("", "\n", calls[:2]),
              ("", "", calls[2:])]
    whole = OutputParts()
    whole.feed("hm ok", "\n Let me look.\n\n", calls[:1] + [{"index": 0, "function": {"arguments": '{"a": 1}'}}],
               final=True)
    streamed, events = OutputParts(), []
    for reasoning, text, chunk in pieces:
        events += streamed.feed(reasoning, text, chunk)
    events += streamed.feed("", "", [], final=True)
    assert [block(p) for p in streamed.parts] == [block(p) for p in whole.parts] == [
        {"type": "thinking", "thinking": "hm ok", "signature": ""}, {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]
    assert [e[0] for e in events if e[0] != "delta"] == ["start", "stop"] * 3
    empty = OutputParts()
    empty.feed("", " \n", [], final=True)
    assert [block(p) for p in empty.parts] == [{"type": "text", "text": ""}]


# Qwen3's switch: thinking closed at once when the request says enable_thinking false
SWITCHED = THINKING_CHATML.replace("'<|im_start|>assistant\n<think>\n'", "'<|im_start|>assistant\n' + ("
                                   "'<think>\n\n</think>\n\n' if enable_thinking is false else '<think>\n')")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-thinking-messages"), thinking=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert SWITCHED != config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SWITCHED}))
    s = LiveServer("--model", str(model), "--kv-cache-gib", "0.05")
    yield s
    assert s.stop() == 0, s.output()


def test_a_reasoning_models_thinking_is_a_thinking_block(thinker):
    name = httpx.get(thinker.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    with anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0, timeout=120) as c:
        kwargs = dict(model=name, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Hello"}],
                      thinking={"type": "enabled", "budget_tokens": 8})
        whole = c.messages.create(**kwargs)
        with c.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        assert whole.content[0].type == "thinking" and whole.content[0].thinking
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
        opened = c.messages.count_tokens(model=name, messages=kwargs["messages"]).input_tokens
        closed = c.messages.count_tokens(model=name, messages=kwargs["messages"],
                                         thinking={"type": "disabled"}).input_tokens
        assert closed > opened  # the template's enable_thinking switch closed the thinking
        answer = c.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
        assert [b.type for b in answer.content] == ["text"]
