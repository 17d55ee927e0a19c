"""OpenAI's Responses API through the official `openai` client on the default model, every body
and event checked against OpenAI's published schemas:
responses.create and responses.stream (the stream's final response is the one the store keeps),
a function call round trip by previous_response_id and by the whole input, instructions,
text.format, the store's retrieve and delete, and refusals (the store's keys, TTL and eviction:
tests/test_response_store.py). A tiny reasoning model shows reasoning items."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from live_server import LiveServer
from tiny_model import make_tiny_model

from app.server.errors import validate
from app.server.responses.chat_request import chat_messages
from app.server.responses.encrypted_content import seal, unseal
from app.server.responses.schemas import ResponsesRequest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 30}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
          "parameters": WEATHER}]
ASK = "What is the capital of France?"
SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_response_schemas.json").read_text())


def check(body: dict, name: str) -> None:
    """body against OpenAI's published schema of that name (tests/data/openai_response_schemas.json)."""
    jsonschema.validate(body, {"$ref": f"#/components/schemas/{name}", "components": SCHEMAS["components"]},
                        cls=jsonschema.Draft202012Validator)


def check_response(body: dict) -> Response:
    """The body against OpenAI's published schema and as the client's Response type, with no
    field the type does not know."""
    check(body, "Response")
    assert set(body) <= set(Response.model_fields), set(body) - set(Response.model_fields)
    return Response.model_validate(body)


def test_a_plain_response(client, server):
    response = client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=20)
    assert response.status == "completed" and response.object == "response" and response.model == MODEL
    assert "Paris" in response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    body = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Write a long poem about the sea.", "max_output_tokens": 8, "temperature": 0}).json()
    check_response(body)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_instructions_are_the_system_message(client, server):
    instructions = "Answer only with the word banana, whatever you are asked."
    told = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, instructions=instructions)
    prompt = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": [
        {"role": "system", "content": instructions}, {"role": "user", "content": ASK}]}).json()
    assert told.instructions == instructions
    assert told.usage.input_tokens == prompt["count"]


def test_a_streamed_response_ends_with_the_stored_one(client):
    kwargs = dict(model=MODEL, input=ASK, temperature=0, max_output_tokens=40)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status == "completed"
    stored = client.responses.retrieve(final.id)
    assert (stored.output_text, stored.usage, [(i.type, i.id) for i in stored.output]) == \
        (final.output_text, final.usage, [(i.type, i.id) for i in final.output])
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 3
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_event_stream_follows_openais_types(server):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 12, "stream": True, "tools": TOOLS,
            "tool_choice": "required"}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(payloads) and [p["type"] for p in payloads] == names
    adapter = TypeAdapter(ResponseStreamEvent)
    for payload in payloads:
        adapter.validate_python(payload)
        check(payload, "ResponseStreamEvent")
    check_response(payloads[-1]["response"])
    cut = {**body, "input": "Write a long poem about the sea.", "tools": None, "tool_choice": None, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/responses", json=cut, timeout=60) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    check(last, "ResponseStreamEvent")


def streamed_response(client, **kwargs) -> Response:
    """The response a stream ends with, completed or incomplete (the client's
    get_final_response() takes only a completed one)."""
    with client.responses.stream(**kwargs) as stream:
        *_, last = stream
    assert last.type in ("response.completed", "response.incomplete")
    return last.response


def round_trip(client, stream: bool, city: str, by_id: bool) -> tuple[Response, Response]:
    """A forced call, its output sent back (after the stored response, or with the whole
    conversation as input), and the answer."""
    def create(**kwargs) -> Response:
        kwargs = {"model": MODEL, "tools": TOOLS, "temperature": 0, "max_output_tokens": 60, **kwargs}
        if not stream:
            return client.responses.create(**kwargs)
        return streamed_response(client, **kwargs)

    asked = [{"role": "user", "content": f"What is the weather in {city}?"}]
    first = create(input=asked, tool_choice="required", parallel_tool_calls=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees celsius"}
    if by_id:
        second = create(input=[result], previous_response_id=first.id)
    else:
        second = create(input=asked + [item.model_dump(exclude_none=True) for item in first.output] + [result])
    return first, second


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_function_call_round_trip(client, stream):
    with ThreadPoolExecutor(3) as pool:
        trips = list(pool.map(lambda city: round_trip(client, stream, city, by_id=True), ["Paris", "Tokyo", "Lima"]))
    for first, second in trips:
        (call,) = first.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert second.previous_response_id == first.id and second.output
        assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result came along


def test_previous_response_id_is_the_same_as_sending_the_conversation(client):
    _, by_id = round_trip(client, False, "Oslo", by_id=True)
    _, whole = round_trip(client, False, "Oslo", by_id=False)
    assert by_id.usage.input_tokens == whole.usage.input_tokens
    assert [i.model_dump(exclude={"id", "call_id"}) for i in by_id.output] == \
        [i.model_dump(exclude={"id", "call_id"}) for i in whole.output]


def test_text_format_holds_the_output_to_the_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["capital"],
              "properties": {"capital": {"type": "string", "maxLength": 20}}}
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_the_store_retrieves_deletes_and_skips_store_false(client):
    kept = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4)
    assert client.responses.retrieve(kept.id).id == kept.id
    unkept = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="more", previous_response_id=unkept.id)
    assert missing.value.body["param"] == "previous_response_id"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


@pytest.mark.parametrize("body, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input_image parts are not supported"),
    ({"input": ASK, "tools": [{"type": "custom", "name": "x", "format": {"type": "grammar"}}]},
     "syntax and definition"),
    ({"input": ASK, "background": True}, "background"),
    ({"input": []}, "input is empty"),
    ({"input": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
])
def test_refusals_name_the_field(server, body, words):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-thinking-responses"), thinking=True)
    s = LiveServer("--model", str(model), "--kv-cache-gib", "0.05")
    yield s
    assert s.stop() == 0, s.output()


def test_a_reasoning_models_thinking_is_a_reasoning_item(thinker):
    with thinker.openai_client() as c:
        name = c.models.list().data[0].id
        kwargs = dict(model=name, input="Hello", temperature=0, max_output_tokens=24)
        whole = c.responses.create(**kwargs)
        streamed = streamed_response(c, **kwargs)
        reasoning = whole.output[0]
        assert reasoning.type == "reasoning" and reasoning.content[0].text
        assert [i.model_dump(exclude={"id"}) for i in streamed.output] == \
            [i.model_dump(exclude={"id"}) for i in whole.output]
        # the reasoning goes back as the next assistant message's reasoning_content
        again = c.responses.create(model=name, input="And then?", previous_response_id=whole.id, max_output_tokens=4)
        assert again.usage.input_tokens > whole.usage.input_tokens
        assert reasoning.encrypted_content is None  # not asked for
        sealed = c.responses.create(**kwargs, store=False, include=["reasoning.encrypted_content"]).output[0]
        assert sealed.content == reasoning.content and unseal(sealed.encrypted_content) == reasoning.content[0].text


def test_reasoning_comes_back_from_encrypted_content():
    """What Codex sends with store false: the reasoning item with only its encrypted_content."""
    items = [{"type": "message", "role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [], "encrypted_content": seal("They greet me.")},
             {"type": "message", "role": "assistant", "content": "Hello!"},
             {"type": "message", "role": "user", "content": "Find Ada"},
             {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-an-openai-blob"},
             {"type": "function_call", "call_id": "c1", "namespace": "crm", "name": "lookup", "arguments": "{}"}]
    messages = chat_messages(validate(ResponsesRequest, {"input": items}).input)
    assert messages[1] == {"role": "assistant", "content": "Hello!", "reasoning_content": "They greet me."}
    assert messages[3]["tool_calls"][0]["function"]["name"] == "crm__lookup" and "reasoning_content" not in messages[3]
