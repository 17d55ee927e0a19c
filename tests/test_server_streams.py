"""Streams under stress on a live server: clients that leave, WebSocket generations, SIGTERM
with streams in flight, and 200 concurrent clients."""

import json
import random
import signal
import time

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from live_server import LiveServer

LONG_PROMPT = "Tell me everything about " + "the history of the world, " * 60


def chat_body(content: str, max_tokens: int, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True, "temperature": 0, **extra}).encode()


async def open_stream(port: int, body: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    await stream.send_all(head + body)
    return stream


async def read_events(stream: trio.SocketStream, count: int) -> bytes:
    """Read until count SSE content events have arrived (or the stream ends)."""
    data = b""
    while data.count(b'"content":"') < count + 1:  # +1: the opening role chunk
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return data


async def wait_idle(server: LiveServer, seconds: float = 60) -> dict:
    with trio.fail_after(seconds):
        while True:
            m = await trio.to_thread.run_sync(server.metrics)
            values = {k.split("{")[0]: v for k, v in m.items()}
            if (values["spool:num_requests_running"] == 0 and values["spool:num_requests_waiting"] == 0
                    and values["spool:kv_cache_usage_perc"] == 0):
                return m
            await trio.sleep(0.2)


@pytest.fixture(scope="module")
def storm_server():
    s = LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8", "--prefill-chunk", "32", "--max-model-len", "2048")
    yield s
    assert s.stop() == 0, s.output()


async def test_disconnect_storm_leaves_nothing_behind(storm_server):
    port = storm_server.port
    rng = random.Random(7)

    async def client(i: int):
        long_prompt = i % 3 == 0
        body = chat_body((LONG_PROMPT if long_prompt else "Count to a hundred.") + f" #{i}", max_tokens=400)
        stream = await open_stream(port, body)
        try:
            kind = i % 3
            if kind == 0:  # gone while waiting or mid-prefill
                await trio.sleep(rng.uniform(0, 0.3))
            elif kind == 1:  # gone right away
                pass
            else:  # gone while decoding
                with trio.move_on_after(30):
                    await read_events(stream, rng.randint(1, 6))
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(client, i)
    metrics = await wait_idle(storm_server)
    finished = {k.split('finished_reason="')[1].split('"')[0]: v for k, v in metrics.items()
                if k.startswith("spool:request_success_total")}
    # every request that reached the engine was cancelled: none ran on to its 400 tokens (a
    # client gone before its body was read never became a request at all)
    assert finished["length"] == finished["stop"] == finished["error"] == 0, finished
    assert finished["cancelled"] >= 17, finished  # at least every client that read tokens
    # prefix-cached blocks may stay, but they are evictable: the server still takes work
    r = await trio.to_thread.run_sync(lambda: httpx.post(
        storm_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_websocket_two_generations_cancel_one_then_close(storm_server):
    url = f"ws://127.0.0.1:{storm_server.port}/v1/ws"
    async with open_websocket_url(url) as ws:
        for bad in ("not json", "[" * 100_000 + "]" * 100_000):  # malformed, and nested past the parser's limit
            await ws.send_message(bad)
            error = json.loads(await ws.get_message())
            assert error["type"] == "error" and error["error"]["message"], error
        await ws.send_message(json.dumps({"type": "generate", "id": "a", "prompt": "Once upon a time",
                                          "max_tokens": 400, "ignore_eos": True}))
        await ws.send_message(json.dumps({"type": "generate", "id": "b", "temperature": 0, "max_tokens": 20,
                                          "messages": [{"role": "user", "content": "What is the capital of France?"}]}))
        seen: dict[str, str] = {"a": "", "b": ""}
        done: dict[str, dict] = {}
        cancelled = False
        with trio.fail_after(120):
            while len(done) < 2:
                frame = json.loads(await ws.get_message())
                assert frame["type"] in ("delta", "done"), frame
                if frame["type"] == "delta":
                    seen[frame["id"]] += frame["text"]
                    if frame["id"] == "a" and not cancelled and len(seen["a"]) > 10:
                        await ws.send_message(json.dumps({"type": "cancel", "id": "a"}))
                        cancelled = True
                else:
                    done[frame["id"]] = frame
        assert done["a"]["choices"][0]["finish_reason"] == "cancelled"
        assert done["b"]["choices"][0]["finish_reason"] == "stop" and "Paris" in seen["b"]
        assert done["b"]["usage"]["completion_tokens"] > 0
        # a third generation left running when the socket closes
        await ws.send_message(json.dumps({"type": "generate", "id": "c", "prompt": "Hello", "max_tokens": 400,
                                          "ignore_eos": True}))
        frame = json.loads(await ws.get_message())
        assert frame["id"] == "c"
    await wait_idle(storm_server)


async def test_sigterm_drains_short_streams_and_ends_long_ones():
    server = LiveServer("--kv-cache-gib", "0.1", "--shutdown-timeout", "10")
    results: dict[str, bytes] = {"short": b"", "long": b""}

    async def client(name: str, max_tokens: int):
        stream = await open_stream(server.port, chat_body("Write a long story.", max_tokens))
        with trio.fail_after(60):
            while b"data: [DONE]" not in results[name]:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                results[name] += chunk
        await stream.aclose()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, "short", 20)
            nursery.start_soon(client, "long", 3000)
            with trio.fail_after(60):  # both streaming
                while not all(data.count(b'"content":"') > 2 for data in results.values()):
                    await trio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            await trio.sleep(0.3)
            # a router sees the drain at once, and is told when to come back
            refused = await trio.to_thread.run_sync(lambda: httpx.get(server.url + "/health", timeout=5))
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            late = await trio.to_thread.run_sync(lambda: httpx.post(
                server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5))
            assert late.status_code == 503 and late.headers["Retry-After"] == "1"
            assert late.json()["error"]["code"] == "draining"
        last_stream_ended = time.monotonic()
        code = await trio.to_thread.run_sync(server.proc.wait, 60)
        assert time.monotonic() - last_stream_ended < 2  # it exits when the last stream ends
    finally:
        server.stop()
    assert code == 0, server.output()
    assert b'"finish_reason":"length"' in results["short"] and b"data: [DONE]" in results["short"]
    assert b'"finish_reason":"cancelled"' in results["long"] and b"data: [DONE]" in results["long"]


@pytest.mark.slow
async def test_200_concurrent_streaming_clients_all_finish():
    server = LiveServer("--kv-cache-gib", "0.25", "--max-seqs", "64")
    finished = []

    async def client(i: int):
        stream = await open_stream(server.port, chat_body(f"Say something about the number {i}.", max_tokens=8))
        data = b""
        while b"data: [DONE]" not in data:
            chunk = await stream.receive_some(65536)
            assert chunk, f"client {i}: the stream ended early"
            data += chunk
        await stream.aclose()
        assert b'"finish_reason":"length"' in data
        finished.append(i)

    try:
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(client, i)
        assert sorted(finished) == list(range(200))
        await wait_idle(server)
    finally:
        assert server.stop() == 0, server.output()
