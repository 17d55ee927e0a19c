"""Spool's bodies against OpenAI's own published schemas (tests/data/openai_response_schemas.json,
which names its source and version): chat and text completions, streamed and not, with
logprobs and usage, the model list, and errors; and the Responses API's object and events, for
POST /v1/responses."""

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from live_server import LiveServer

SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_response_schemas.json").read_text())
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6}


def check(body: dict, name: str) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": SCHEMAS["components"]}
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


def chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8")
    yield s
    s.stop()


def test_the_schemas_are_strict_enough_to_fail():
    with pytest.raises(jsonschema.ValidationError):
        check({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},  # no refusal
                            "finish_reason": "stop", "logprobs": None}]}, "CreateChatCompletionResponse")
    with pytest.raises(jsonschema.ValidationError):
        check({"error": {"message": "m", "type": "t", "param": None, "code": 400}}, "ErrorResponse")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2, "n": 2},
                                   {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40, "n": 2}],
                         ids=["plain", "logprobs", "tools"])
def test_chat_bodies_and_chunks_follow_openais_schemas(server, extra):
    url = server.url + "/v1/chat/completions"
    body = httpx.post(url, json={**CHAT, **extra}, timeout=60).json()
    check(body, "CreateChatCompletionResponse")
    streamed = chunks(url, {**CHAT, **extra})
    for chunk in streamed:
        check(chunk, "CreateChatCompletionStreamResponse")
    if "tools" in extra:  # the shapes checked include calls, whole and in pieces
        assert all(choice["message"]["tool_calls"] for choice in body["choices"])
        assert any(choice["delta"].get("tool_calls") for chunk in streamed for choice in chunk["choices"])


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2, "echo": False, "n": 2}])
def test_completion_bodies_and_chunks_follow_openais_schemas(server, extra):
    url = server.url + "/v1/completions"
    body = {"prompt": "The capital of France is", "max_tokens": 5, **extra}
    check(httpx.post(url, json=body, timeout=60).json(), "CreateCompletionResponse")
    for chunk in chunks(url, body):
        if not chunk["choices"]:  # the usage chunk: OpenAI's schema describes only whole completions
            continue
        # OpenAI streams legacy completions with finish_reason null until the last chunk, though
        # its schema (written for the whole object) has no null there
        for choice in chunk["choices"]:
            assert choice["finish_reason"] in (None, "stop", "length")
            choice["finish_reason"] = choice["finish_reason"] or "length"
        check(chunk, "CreateCompletionResponse")


def test_the_model_list_and_errors_follow_openais_schemas(server):
    check(httpx.get(server.url + "/v1/models").json(), "ListModelsResponse")
    for body in ({"messages": []}, {"messages": CHAT["messages"], "temperature": -1}, {"model": "nope", **CHAT}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code in (400, 404)
        check(r.json(), "ErrorResponse")


def test_the_responses_schemas_are_there_and_strict():
    """The Responses API's object and its events, for POST /v1/responses: a minimal reply passes,
    and one without its output does not."""
    text = {"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [text]}
    usage = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}
    response = {"id": "resp_1", "object": "response", "created_at": 1767225600, "model": "m",
                "status": "completed", "output": [message], "error": None, "incomplete_details": None,
                "instructions": None, "metadata": {}, "parallel_tool_calls": True, "temperature": 1.0,
                "top_p": 1.0, "tool_choice": "auto", "tools": [], "usage": usage}
    check(response, "Response")
    with pytest.raises(jsonschema.ValidationError, match="'output' is a required property"):
        check({k: v for k, v in response.items() if k != "output"}, "Response")
    with pytest.raises(jsonschema.ValidationError):  # an output_text part must carry its logprobs
        check({**response, "output": [{**message, "content": [{**text, "logprobs": None}]}]}, "Response")
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "Paris.", "logprobs": []}
    for event in ({"type": "response.created", "sequence_number": 0,
                   "response": {**response, "status": "in_progress", "output": []}},
                  delta, {"type": "response.completed", "sequence_number": 2, "response": response}):
        check(event, "ResponseStreamEvent")
    with pytest.raises(jsonschema.ValidationError):
        check({**delta, "type": "response.output_text.deltas"}, "ResponseStreamEvent")
