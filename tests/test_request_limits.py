"""Limits before work (app/server/request_limits.py): what one request may ask for is checked on
its parsed body before any tokenizing, each a 400 naming the field, and the work a body takes
(decoding, validating, rendering, tokenizing) runs off the event loop, so /health answers while
the largest body is read. A chat template that never ends, or writes without end, is a 400."""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from live_server import LiveServer
from model.tokenizer import ChatTemplateError, Tokenizer

SMALL = ("--max-choices-per-request", "4", "--max-embedding-inputs", "5", "--max-messages", "4", "--max-tools", "2",
         "--max-schema-bytes", "300", "--max-stop-strings", "3", "--max-stop-chars", "10")

# ChatML, unless a template variable asks for a loop that never ends or output without end
RUNAWAY = (
    "{% if forever %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% if huge %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def small(tiny_dir):
    s = LiveServer(str(tiny_dir), "--kv-cache-gib", "0.05", *SMALL)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def roomy(tiny_dir):
    """Default request limits, a short queue, and a chat template that can run away."""
    s = LiveServer(str(tiny_dir), "--kv-cache-gib", "0.05", "--max-queue", "32", "--chat-template", RUNAWAY,
                   "--chat-template-timeout", "1", "--max-chat-template-chars", "100000")
    yield s
    assert s.stop() == 0, s.output()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def refused(server, path: str, body: dict, param: str) -> str:
    """The 400's message, after checking it names param in OpenAI's shape."""
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def refused_anthropic(server, body: dict, param: str) -> str:
    """/v1/messages' 400, in Anthropic's shape, whose message names param first."""
    r = post(server, "/v1/messages", body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{param} "), message
    return message


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def completion(**fields) -> dict:
    return {"prompt": "Hi", "max_tokens": 1, **fields}


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 1, **fields}


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def schema_of_bytes(size: int) -> dict:
    """A JSON schema whose compact JSON is size bytes."""
    base = {"type": "object", "description": ""}
    pad = size - len(json.dumps(base, separators=(",", ":")))
    return {"type": "object", "description": "x" * pad}


# -- the must-show: a huge body is refused at once, and /health answers all along ---------------


def health_while(server, send) -> tuple[httpx.Response, float, list[float]]:
    """send(client) on one connection while another polls /health: send's response, the seconds
    it took, and every /health's latency (after a warm-up, so that first-request costs don't count)."""
    latencies, done = [], threading.Event()

    def poll():
        with httpx.Client(base_url=server.url, timeout=10) as health:
            while not done.is_set():
                start = time.perf_counter()
                assert health.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)

    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):  # connections open, the route's code paths run once
            assert client.post("/v1/completions", json=completion()).status_code == 200
        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.2)
        start = time.perf_counter()
        response = send(client)
        took = time.perf_counter() - start
        time.sleep(0.2)
        done.set()
        poller.join()
    return response, took, latencies


def test_a_body_of_100000_prompts_at_n_16_is_refused_at_once_while_health_answers(roomy):
    body = json.dumps({"prompt": ["hi"] * 100_000, "n": 16, "max_tokens": 1}).encode()
    assert len(body) > 500_000
    r, took, latencies = health_while(roomy, lambda client: client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "1600000 choices" in r.json()["error"]["message"]
    assert took < 1.0, took
    assert len(latencies) > 10 and max(latencies) < 0.1, sorted(latencies)[-5:]
    roomy.assert_serving()


def test_health_answers_while_a_long_prompt_is_tokenized(roomy):
    prompt = "Hello there. " * 80_000  # a megabyte: half a million ids here, a second of tokenizing
    r, took, latencies = health_while(roomy, lambda client: client.post("/tokenize", json={"prompt": prompt}))
    assert r.status_code == 200 and r.json()["count"] > 100_000, r.text
    # on the event loop, tokenizing would keep one /health waiting about as long as the request took
    assert len(latencies) > 10 and max(latencies) < took / 4, (took, sorted(latencies)[-5:])


def test_more_choices_than_the_queue_holds_is_a_400_not_a_429(roomy):
    message = refused(roomy, "/v1/completions", completion(prompt=["Hi"] * 11, n=3), "prompt")
    assert "--max-queue" in message
    assert len(ok(roomy, "/v1/completions", completion(prompt=["Hi"] * 8, n=4))["choices"]) == 32
    message = refused(roomy, "/v1/embeddings", {"input": ["Hi"] * 33}, "input")
    assert "--max-queue" in message
    assert len(ok(roomy, "/v1/embeddings", {"input": ["Hi"] * 32})["data"]) == 32


# -- each limit: a 400 naming the field; just under it works -------------------------------------


def test_prompts_times_n(small):
    assert len(ok(small, "/v1/completions", completion(prompt=["Hi", "Yo"], n=2))["choices"]) == 4
    assert "--max-choices-per-request" in refused(small, "/v1/completions", completion(prompt=["Hi"] * 5), "prompt")
    refused(small, "/v1/completions", completion(prompt=[[5, 6]] * 3, n=2), "prompt")
    refused(small, "/v1/completions", completion(n=5), "n")
    assert len(ok(small, "/v1/chat/completions", chat(n=4))["choices"]) == 4
    refused(small, "/v1/chat/completions", chat(n=5), "n")
    refused(small, "/v1/completions/render", completion(prompt=["Hi"] * 5), "prompt")


def test_embedding_inputs(small):
    assert len(ok(small, "/v1/embeddings", {"input": ["Hi"] * 5})["data"]) == 5
    assert "--max-embedding-inputs" in refused(small, "/v1/embeddings", {"input": ["Hi"] * 6}, "input")
    refused(small, "/v1/embeddings", {"input": [[5]] * 6}, "input")


def test_messages(small):
    four, five = HI * 4, HI * 5
    ok(small, "/v1/chat/completions", chat(messages=four))
    assert "--max-messages" in refused(small, "/v1/chat/completions", chat(messages=five), "messages")
    ok(small, "/tokenize", {"messages": four})
    refused(small, "/tokenize", {"messages": five}, "messages")
    ok(small, "/v1/chat/completions/render", {"messages": four})
    refused(small, "/v1/chat/completions/render", {"messages": five}, "messages")
    ok(small, "/v1/responses", {"input": four, "max_output_tokens": 1})
    refused(small, "/v1/responses", {"input": five, "max_output_tokens": 1}, "input")
    ok(small, "/v1/messages", {"messages": four, "max_tokens": 1})
    refused_anthropic(small, {"messages": five, "max_tokens": 1}, "messages")


def test_a_responses_conversation_counts_what_it_continues(small):
    first = ok(small, "/v1/responses", {"input": HI * 2, "max_output_tokens": 1})  # 3 items with its output
    ok(small, "/v1/responses", {"input": HI, "previous_response_id": first["id"], "max_output_tokens": 1})
    refused(small, "/v1/responses", {"input": HI * 2, "previous_response_id": first["id"], "max_output_tokens": 1},
            "input")


def test_tools(small):
    ok(small, "/v1/chat/completions", chat(tools=[tool("a"), tool("b")]))
    assert "--max-tools" in refused(small, "/v1/chat/completions", chat(tools=[tool(n) for n in "abc"]), "tools")
    refused(small, "/tokenize", {"messages": HI, "tools": [tool(n) for n in "abc"]}, "tools")
    anthropic = [{"name": n, "input_schema": {"type": "object"}} for n in "abc"]
    refused_anthropic(small, {"messages": HI, "max_tokens": 1, "tools": anthropic}, "tools")


def test_schema_bytes(small):
    ok(small, "/v1/chat/completions", chat(tools=[tool("a", schema_of_bytes(300))]))
    message = refused(small, "/v1/chat/completions", chat(tools=[tool("a", schema_of_bytes(301))]),
                      "tools.0.function.parameters")
    assert "301 bytes" in message and "--max-schema-bytes" in message
    fits = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_of_bytes(300)}}
    ok(small, "/v1/completions", completion(response_format=fits))
    over = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_of_bytes(301)}}
    refused(small, "/v1/completions", completion(response_format=over), "response_format.json_schema.schema")
    refused(small, "/v1/completions", completion(guided_json=json.dumps(schema_of_bytes(301))), "guided_json")
    refused(small, "/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                        "schema": schema_of_bytes(301)}}},
            "text.format.schema")


def test_stop_strings(small):
    ok(small, "/v1/completions", completion(stop=["a" * 10, "b", "c"]))
    assert "--max-stop-strings" in refused(small, "/v1/completions", completion(stop=["a", "b", "c", "d"]), "stop")
    assert "--max-stop-chars" in refused(small, "/v1/chat/completions", chat(stop="a" * 11), "stop")
    ok(small, "/v1/messages", {"messages": HI, "max_tokens": 1, "stop_sequences": ["a", "b", "c"]})
    refused_anthropic(small, {"messages": HI, "max_tokens": 1, "stop_sequences": ["a", "b", "c", "d"]},
                      "stop_sequences")


async def test_a_websocket_generate_frame_over_a_limit_gets_an_error_frame(small):
    async with open_websocket_url(f"ws://127.0.0.1:{small.port}/v1/ws") as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "big", "prompt": ["Hi"] * 5, "max_tokens": 1}))
        await ws.send_message(json.dumps({"type": "generate", "id": "chat", "messages": HI * 5, "max_tokens": 1}))
        await ws.send_message(json.dumps({"type": "generate", "id": "fits", "prompt": ["Hi"] * 4, "max_tokens": 1}))
        frames = {}
        with trio.fail_after(30):
            while "fits" not in frames:
                frame = json.loads(await ws.get_message())
                if frame["type"] in ("error", "done"):
                    frames[frame["id"]] = frame
    assert frames["big"]["type"] == "error" and frames["big"]["error"]["param"] == "prompt"
    assert frames["chat"]["type"] == "error" and frames["chat"]["error"]["param"] == "messages"
    assert frames["fits"]["type"] == "done" and len(frames["fits"]["choices"]) == 4


def test_help_documents_the_request_limits():
    out = subprocess.run([sys.executable, "-m", "app", "serve", "--help"], capture_output=True, text=True).stdout
    flat = " ".join(out.split())
    for flag in ("--max-choices-per-request", "--max-embedding-inputs", "--max-messages", "--max-tools",
                 "--max-schema-bytes", "--max-stop-strings", "--max-stop-chars", "--chat-template-timeout",
                 "--max-chat-template-chars", "--request-threads"):
        assert flag in flat
    assert "vLLM has no such limit" in flat and "(default: 1024)" in flat


# -- chat templates that run away ----------------------------------------------------------------


@pytest.mark.parametrize("variable,said", [("forever", "took longer than 1 s"), ("huge", "more than 100000 characters")])
def test_a_runaway_chat_template_is_a_400_and_the_server_keeps_serving(roomy, variable, said):
    answered = []  # (what, when), in the order they came back

    def health_during_the_render():
        time.sleep(0.3)
        assert httpx.get(roomy.url + "/health", timeout=10).status_code == 200
        answered.append("health")

    watcher = threading.Thread(target=health_during_the_render)
    watcher.start()
    message = refused(roomy, "/v1/chat/completions", chat(chat_template_kwargs={variable: True}), "messages")
    answered.append("chat")
    watcher.join()
    assert message.startswith("the chat template") and said in message
    if variable == "forever":  # a second of rendering, in a worker thread: /health is not kept waiting
        assert answered == ["health", "chat"]
    ok(roomy, "/v1/chat/completions", chat())
    roomy.assert_serving()


@pytest.mark.parametrize("template,said", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took longer"),
    ("{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}", "more than 1000 characters"),
    ("{{ 'x' * 10000000000 }}", "more than 1000 characters"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
])
def test_a_render_is_bounded(tiny_dir, template, said):
    tok = Tokenizer(tiny_dir, template, render_seconds=0.2, render_chars=1000)
    with pytest.raises(ChatTemplateError, match=said):
        tok.render_chat(HI)
    assert Tokenizer(tiny_dir, render_seconds=0.2, render_chars=1000).render_chat(HI).startswith("<|im_start|>user")
