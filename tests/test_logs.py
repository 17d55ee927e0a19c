"""The log as vLLM's and llama-server's users read it, from real servers on the tiny model: one
line per request (a stream's when it ends), probes at DEBUG, --log-format json, and the flags
that quiet the request lines."""

import json
import logging
import re
import sys
import time
from datetime import datetime, timedelta

import httpx
import pytest
from trio_websocket import open_websocket_url

from app.logs import JsonFormatter
from live_server import LiveServer

KEY = "log-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
HELLO = [{"role": "user", "content": "Hello"}]
TEXT_LINE = re.compile(r"spool\.http: (?P<remote>\S+) (?P<method>\S+) (?P<path>\S+) (?P<status>\d+)"
                       r" (?P<latency>\d+)ms(?P<rest>.*)")


def text_lines(output: str) -> list[dict]:
    """Every request line of a text log, its key=value fields included."""
    lines = []
    for line in output.splitlines():
        m = TEXT_LINE.search(line)
        if m:
            fields = {**m.groupdict(), **dict(kv.split("=", 1) for kv in m["rest"].split())}
            fields["level"] = line.split()[2]
            lines.append(fields)
    return lines


def wait_for(server: LiveServer, since: int, found, timeout: float = 10) -> list[str]:
    """The output's lines after offset since, once found(lines) holds (a line is written just
    after the response's last byte, so the client may see it first)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = server.output()[since:].splitlines()
        if found(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = LiveServer("--model", str(tiny_dir), "--kv-cache-gib", "0.05", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def json_server(tiny_dir):
    s = LiveServer("--model", str(tiny_dir), "--kv-cache-gib", "0.05", "--log-level", "debug", "--log-format", "json")
    yield s
    s.stop()


def test_probes_polled_100_times_leave_no_info_line(server):
    since = len(server.output())
    for _ in range(100):
        assert httpx.get(server.url + "/health").status_code == 200
    for _ in range(5):
        assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200  # an INFO line to wait for
    lines = wait_for(server, since, lambda lines: any("GET /v1/models 200" in line for line in lines))
    assert [line for line in lines if "GET /v1/models 200" in line]
    assert not [line for line in lines if "/health" in line or "/metrics" in line]


def test_a_chat_completion_streamed_or_not_gives_one_line_with_its_tokens(server):
    client = server.openai_client(api_key=KEY)
    since = len(server.output())
    once = {"model": "", "messages": HELLO, "temperature": 0, "extra_body": {"ignore_eos": True}}
    reply = client.chat.completions.create(**once, max_tokens=5)
    chunks = list(client.chat.completions.create(**once, max_tokens=7, stream=True,
                                                 stream_options={"include_usage": True}))
    ids = {reply.id: reply.usage, chunks[0].id: chunks[-1].usage}
    wait_for(server, since, lambda lines: len(text_lines("\n".join(lines))) >= 2)
    lines = text_lines(server.output()[since:])
    assert len(lines) == 2, lines  # nothing else: no second line per generation
    for line in lines:
        usage = ids[line["id"]]
        assert (line["method"], line["path"], line["status"], line["level"]) == (
            "POST", "/v1/chat/completions", "200", "INFO")
        assert int(line["prompt_tokens"]) == usage.prompt_tokens
        assert int(line["completion_tokens"]) == usage.completion_tokens > 0
        assert line["finish"] == "length" and line["ttft"].endswith("ms")
        assert int(line["latency"]) >= int(line["ttft"][:-2])
    assert {line["id"] for line in lines} == set(ids)
    for rid in ids:  # under no other logger either
        assert sum(rid in line for line in server.output()[since:].splitlines()) == 1


@pytest.mark.parametrize("headers,body,status", [(AUTH, b"{not json", 400), ({}, b'{"messages": []}', 401)])
def test_refused_requests_get_their_line(server, headers, body, status):
    since = len(server.output())
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={**headers, **JSON})
    assert r.status_code == status
    wait_for(server, since, lambda lines: text_lines("\n".join(lines)))
    (line,) = text_lines(server.output()[since:])
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", str(status))
    assert "id" not in line and "completion_tokens" not in line


async def test_a_websocket_generation_gets_its_line_and_the_socket_one_at_close(server):
    since = len(server.output())
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/v1/ws", extra_headers=list(AUTH.items())) as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "g", "prompt": "Hello", "max_tokens": 3,
                                          "ignore_eos": True}))
        while (frame := json.loads(await ws.get_message()))["type"] != "done":
            pass
        await ws.send_message(json.dumps({"type": "cancel", "id": "nothing-runs"}))
        assert json.loads(await ws.get_message())["type"] == "error"
    wait_for(server, since, lambda lines: any("GET /v1/ws 101" in line for line in lines))
    generation, refused, socket = text_lines(server.output()[since:])
    assert (generation["method"], generation["path"], generation["status"]) == ("WS", "/v1/ws", "200")
    assert int(generation["completion_tokens"]) == frame["usage"]["completion_tokens"] == 3
    assert (refused["method"], refused["status"], "id" in refused) == ("WS", "400", False)
    assert (socket["method"], socket["path"], socket["status"]) == ("GET", "/v1/ws", "101")


def test_json_lines_carry_the_request_fields_and_debug_shows_the_probes(json_server):
    for _ in range(3):
        httpx.get(json_server.url + "/health")
    reply = httpx.post(json_server.url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}).json()
    json_server.stop()
    records = [json.loads(line) for line in json_server.log_path.read_text().splitlines()]  # every line
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
        assert datetime.fromisoformat(record["time"]).utcoffset() == timedelta(0)
    assert any(r["logger"] == "spool.engine" and r["level"] == "INFO" for r in records)
    probes = [r for r in records if r.get("path") == "/health"]
    assert len(probes) >= 3 and {r["level"] for r in probes} == {"DEBUG"}
    (line,) = [r for r in records if r.get("path") == "/v1/completions"]
    assert line["level"] == "INFO" and line["logger"] == "spool.http"
    assert (line["method"], line["status"], line["request_id"]) == ("POST", 200, reply["id"])
    assert (line["prompt_tokens"], line["completion_tokens"]) == (reply["usage"]["prompt_tokens"], 4)
    assert 0 < line["ttft_ms"] <= line["latency_ms"] and line["finish_reason"] == "length"


def test_an_exception_is_one_json_line_with_its_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("spool.test").makeRecord("spool.test", logging.ERROR, __file__, 1, "failed %s",
                                                              ("here",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "failed here" and parsed["level"] == "ERROR"
    assert parsed["exc_info"].startswith("Traceback") and "ValueError: boom" in parsed["exc_info"]


@pytest.mark.parametrize("flags", [("--disable-log-requests",), ("--uvicorn-log-level", "warning")])
def test_quieted_request_lines_leave_the_engine_lines(tiny_dir, flags):
    s = LiveServer("--model", str(tiny_dir), "--kv-cache-gib", "0.05", *flags)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200
        assert httpx.post(s.url + "/v1/completions", content=b"{", headers=JSON).status_code == 400
    finally:
        s.stop()
    output = s.log_path.read_text()
    assert "spool.engine: Prefill batch" in output  # INFO lines still come
    assert "spool.http" not in output, output
