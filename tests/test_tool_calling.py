"""Tool calling on the default model through the official openai client: tool_choice required,
a named function and auto, streamed and not, and a whole round trip (call, tool result, answer)."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest


MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "additionalProperties": False,
                                                          "properties": {"city": {"type": "string", "maxLength": 30}}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"]


def calls_of(client, messages, stream: bool, **kwargs) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(finish_reason, content, [(name, arguments)]) of one choice, assembled from the stream
    the way a client does when stream is set."""
    kwargs = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 80, "seed": 3, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, choice.message.content, calls
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


def check_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_required_makes_calls_that_validate(client, stream):
    with ThreadPoolExecutor(len(CITIES)) as pool:
        results = list(pool.map(lambda city: calls_of(client, ask(city), stream, tool_choice="required",
                                                      parallel_tool_calls=False), CITIES))
    for reason, content, calls in results:
        assert reason == "tool_calls" and content is None and len(calls) == 1
        check_calls(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_named_function_is_the_one_called(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    with ThreadPoolExecutor(len(CITIES)) as pool:
        results = list(pool.map(lambda city: calls_of(client, ask(city), stream, tool_choice=named), CITIES))
    for reason, content, calls in results:
        assert reason == "stop" and content is None and len(calls) == 1  # "stop", as OpenAI's named calls end
        check_calls(calls, names={"get_time"})


def earlier_call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_lets_the_model_call_after_examples_and_the_call_validates(client, stream):
    """A 135M model does not call tools unprompted (it writes prose: the other half of auto);
    two earlier calls in the conversation show it the format, and then it calls."""
    history = ask("Rome") + [earlier_call("Rome", 1)] + ask("Madrid") + [earlier_call("Madrid", 2)]
    with ThreadPoolExecutor(len(CITIES)) as pool:
        results = list(pool.map(lambda city: calls_of(client, history + ask(city), stream, temperature=0), CITIES))
    for reason, content, calls in results:
        assert reason == "tool_calls" and not content
        check_calls(calls)
    assert len({json.loads(calls[0][1])["city"] for _, _, calls in results}) > 3  # it read each question
    reason, content, calls = calls_of(client, ask("Paris"), stream, temperature=0, max_tokens=20)
    assert reason == "length" and content and not calls


def test_a_whole_round_trip_through_the_clients_own_types(client):
    messages = ask("Paris")
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    check_calls([(call.function.name, call.function.arguments)])
    messages.append(message)  # the client's ChatCompletionMessage, sent back as it is
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": "Paris", "temperature": 18, "sky": "cloudy"})})
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    final = answer.choices[0]
    assert final.message.content and not final.message.tool_calls and final.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "tools": TOOLS}, "tools"),
    ("/v1/chat/completions", {"messages": ask("Rome"), "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ask("Rome"), "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ask("Rome"), "tools": TOOLS, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": ask("Rome"), "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/nowhere"}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": ask("Rome"), "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools"),
])
def test_a_request_tools_cannot_serve_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
    server.assert_serving()


def test_tool_choice_none_answers_in_text(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("Rome"), tools=TOOLS, tool_choice="none",
                                           max_tokens=10)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ask("Rome"), tool_choice="required", max_tokens=5)


async def test_the_websocket_done_frame_carries_the_calls(server):
    import trio
    from trio_websocket import open_websocket_url

    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "t", "messages": ask("Oslo"), "tools": TOOLS,
                                          "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 150,
                                          "seed": 3}))
        text = ""
        with trio.fail_after(120):
            while (frame := json.loads(await ws.get_message()))["type"] == "delta":
                text += frame["text"]
    assert frame["type"] == "done", frame
    choice = frame["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and text.startswith("<tool_call>")
    check_calls([(c["function"]["name"], c["function"]["arguments"]) for c in choice["tool_calls"]])
