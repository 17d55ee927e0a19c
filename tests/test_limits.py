"""Every limit in app/server/limits.py, hit on a live server over real sockets: each gives its
documented status or close code, is counted in spool:connections_closed_total, and leaves the
server serving."""

import json
import random
import signal

import httpx
import openai
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, Request

from live_server import LiveServer

STRICT = ("--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1", "--max-header-bytes", "2048",
          "--max-headers", "20", "--max-body-bytes", "65536", "--ws-max-message-bytes", "8192",
          "--ws-ping-interval", "0.3", "--ws-idle-timeout", "1.5", "--ws-max-generations", "2")


@pytest.fixture(scope="module")
def strict():
    s = LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8", *STRICT)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def crowded():
    s = LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8", "--max-connections", "6",
                   "--keep-alive-timeout", "60", "--header-timeout", "60")
    yield s
    assert s.stop() == 0, s.output()


async def wait_closed(server, reason: str, at_least: float) -> None:
    await trio.to_thread.run_sync(server.wait_closed, reason, at_least)


async def exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Send data, then read until the server closes; the reply and how long that took."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    start = trio.current_time()
    await stream.send_all(data)
    reply = b""
    with trio.fail_after(15):
        while chunk := await stream.receive_some(65536):
            reply += chunk
    await stream.aclose()
    return reply, trio.current_time() - start


def status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, (json.loads(body)["error"] if body.strip() else {})


async def assert_serving(server) -> None:
    await trio.to_thread.run_sync(server.assert_serving)


async def test_oversized_request_head_gets_431(strict):
    before = strict.closed("bad_request")
    reply, _ = await exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431 ")
    reply, _ = await exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                              + b"".join(b"X-%d: 1\r\n" % i for i in range(25)) + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 431 ")
    await wait_closed(strict, "bad_request", before + 2)
    await assert_serving(strict)


async def test_headers_that_trickle_in_get_408_after_the_header_timeout(strict):
    before = strict.closed("header_timeout")
    stream = await trio.open_tcp_stream("127.0.0.1", strict.port)
    start = trio.current_time()
    reply = b""

    async def trickle():
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            await stream.send_all(bytes([byte]))
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                reply += chunk
        nursery.cancel_scope.cancel()
    took = trio.current_time() - start
    status, error = status_and_error(reply)
    assert status == 408 and error["code"] == "header_timeout", reply
    assert 0.9 < took < 4, took  # bytes kept coming: the deadline counts from the first one
    await wait_closed(strict, "header_timeout", before + 1)
    await assert_serving(strict)


async def test_a_body_that_stalls_gets_408(strict):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    reply, took = await exchange(strict.port, head + b'{"prompt": ')
    status, error = status_and_error(reply)
    assert status == 408 and "--body-timeout" in error["message"], reply
    assert b"connection: close" in reply.lower()
    await assert_serving(strict)


async def test_a_body_over_the_limit_gets_413(strict):
    body = b'{"prompt": "' + b"a" * 70000 + b'"}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    reply, _ = await exchange(strict.port, head % len(body) + body)
    status, error = status_and_error(reply)
    assert status == 413 and "--max-body-bytes" in error["message"]
    await assert_serving(strict)


async def test_an_idle_keep_alive_connection_is_closed(strict):
    before = strict.closed("keep_alive")
    reply, took = await exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ") and 0.9 < took < 4, (reply, took)
    await wait_closed(strict, "keep_alive", before + 1)


async def test_by_default_a_connection_outlives_the_openai_clients_keep_alive():
    """The openai client reuses a pooled connection idle up to its keepalive_expiry; were the
    server to close at that same moment, a request could meet the FIN (CI lost one so)."""
    server = LiveServer("--kv-cache-gib", "0.1")
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        for request in range(2):
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            with trio.fail_after(10):
                while b'{"status":"ok"}' not in reply:
                    assert (chunk := await stream.receive_some(65536)), (request, reply)
                    reply += chunk
            if request == 0:
                await trio.sleep(openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 1)
        await stream.aclose()
        assert server.closed("keep_alive") == 0
    finally:
        server.stop()


async def test_pipelined_requests_are_answered_in_order(strict):
    reply, _ = await exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                                           b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 ") == 2 and reply.index(b'"status"') < reply.index(b'"data"')


async def test_back_to_back_and_pipelined_requests_on_one_connection_are_all_answered(strict):
    """Each next request is sent the moment the last response ends (or several at once), so it
    often lands before the server has recycled the connection; none may be lost."""
    rng = random.Random(3)
    stream = await trio.open_tcp_stream("127.0.0.1", strict.port)
    buffer = b""
    with trio.fail_after(60):
        for _ in range(150):
            burst = rng.choice([1, 1, 1, 3])
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * burst)
            while buffer.count(b'{"status":"ok"}') < burst:
                chunk = await stream.receive_some(65536)
                assert chunk, "the server closed a connection that had requests pending"
                buffer += chunk
            buffer = buffer.replace(b'{"status":"ok"}', b"", burst)
    await stream.aclose()


async def test_a_client_that_pipelines_and_leaves_still_aborts_its_generation(strict):
    """With a second request queued behind a long generation, the server keeps reading, so it
    sees the client leave and aborts at the next step instead of generating on."""
    body = json.dumps({"prompt": "Count", "max_tokens": 1000, "ignore_eos": True}).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", strict.port)
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    with trio.fail_after(30):
        while not strict.gauge("num_requests_running"):
            await trio.sleep(0.05)
    await stream.aclose()
    with trio.fail_after(5):  # 1000 tokens would take half a minute
        while strict.gauge("num_requests_running"):
            await trio.sleep(0.05)


async def test_http2_upgrade_header_is_answered_in_http1(strict):
    reply, _ = await exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                                           b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ") and b"101" not in reply.split(b"\r\n")[0]


async def test_websocket_message_over_the_limit_closes_1009(strict):
    async with open_websocket_url(f"ws://127.0.0.1:{strict.port}/v1/ws") as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "g", "prompt": "a" * 9000}))
        with pytest.raises(ConnectionClosed) as raised, trio.fail_after(10):
            await ws.get_message()
    assert raised.value.reason.code == 1009
    await assert_serving(strict)


async def test_websocket_generations_over_the_limit_get_an_error_frame(strict):
    async with open_websocket_url(f"ws://127.0.0.1:{strict.port}/v1/ws") as ws:
        for gid in ("a", "b", "c"):
            await ws.send_message(json.dumps({"type": "generate", "id": gid, "prompt": "Hello", "max_tokens": 20,
                                              "ignore_eos": True}))
        frames = []
        with trio.fail_after(60):
            while sum(f["type"] == "done" for f in frames) < 2:
                frames.append(json.loads(await ws.get_message()))
    errors = [f for f in frames if f["type"] == "error"]
    assert [e["id"] for e in errors] == ["c"] and errors[0]["error"]["code"] == "too_many_generations"
    assert sorted(f["id"] for f in frames if f["type"] == "done") == ["a", "b"]


async def silent_websocket(port: int) -> tuple[list, float]:
    """A WebSocket peer that never answers pings: the events it got, and when the server closed."""
    ws = WSConnection(ConnectionType.CLIENT)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(ws.send(Request(host="127.0.0.1", target="/v1/ws")))
    start, events = trio.current_time(), []
    with trio.fail_after(15):
        while data := await stream.receive_some(65536):
            ws.receive_data(data)
            events += list(ws.events())
            if any(isinstance(e, CloseConnection) for e in events):
                break
    await stream.aclose()
    return events, trio.current_time() - start


async def test_a_websocket_that_answers_no_pings_is_closed_1001(strict):
    before = strict.closed("ws_idle")
    events, took = await silent_websocket(strict.port)
    assert isinstance(events[0], AcceptConnection)
    assert sum(isinstance(e, Ping) for e in events) >= 2  # pinged every 0.3 s
    close = events[-1]
    assert isinstance(close, CloseConnection) and close.code == 1001 and 1.4 < took < 5, (events, took)
    await wait_closed(strict, "ws_idle", before + 1)


async def test_a_quiet_websocket_that_answers_pings_stays_open(strict):
    async with open_websocket_url(f"ws://127.0.0.1:{strict.port}/v1/ws") as ws:
        await trio.sleep(3)  # twice --ws-idle-timeout; trio-websocket answers the pings
        await ws.send_message(json.dumps({"type": "generate", "id": "g", "prompt": "Hello", "max_tokens": 2}))
        with trio.fail_after(30):
            while json.loads(await ws.get_message())["type"] != "done":
                pass


async def open_busy_stream(port: int) -> trio.SocketStream:
    body = json.dumps({"prompt": "Count", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with trio.fail_after(30):
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
    return stream


async def test_at_the_connection_limit_an_idle_connection_makes_room(crowded):
    before = crowded.closed("evicted")
    idle = [await trio.open_tcp_stream("127.0.0.1", crowded.port) for _ in range(6)]
    await trio.sleep(0.2)
    r = await trio.to_thread.run_sync(lambda: httpx.get(crowded.url + "/health", timeout=10))
    assert r.status_code == 200
    with trio.fail_after(5):
        assert await idle[0].receive_some(100) == b""  # the longest idle was closed
    for stream in idle:
        await stream.aclose()
    await wait_closed(crowded, "evicted", before + 1)


async def test_at_the_connection_limit_a_slow_newcomer_evicts_nobody(crowded):
    """A newcomer that sends no whole request head within a second of arriving gets 503, and the
    connections already open stay: reconnecting slow clients cannot churn the server."""
    before = crowded.closed("evicted")
    idle = [await trio.open_tcp_stream("127.0.0.1", crowded.port) for _ in range(6)]
    await trio.sleep(0.2)
    reply, took = await exchange(crowded.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    status, error = status_and_error(reply)
    assert status == 503 and error["code"] == "too_many_connections" and 0.9 < took < 5, (reply, took)
    with trio.move_on_after(0.2):
        assert await idle[0].receive_some(100) != b"", "an open connection was evicted"
    for stream in idle:
        await stream.aclose()
    await trio.sleep(0.5)
    assert crowded.closed("evicted") == before


async def test_at_the_connection_limit_with_every_connection_busy_a_newcomer_gets_503(crowded):
    before = crowded.closed("limit")
    busy = [await open_busy_stream(crowded.port) for _ in range(6)]
    reply, _ = await exchange(crowded.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, error = status_and_error(reply)
    assert status == 503 and error["code"] == "too_many_connections" and b"retry-after: 1" in reply.lower()
    for stream in busy:
        await stream.aclose()
    assert crowded.closed("limit") == before + 1  # scraped once there is room again
    with trio.fail_after(30):
        while crowded.gauge("num_requests_running") or crowded.metrics()["spool:connections_open"] > 1:
            await trio.sleep(0.1)
    await assert_serving(crowded)


async def test_on_sigterm_an_idle_connection_closes_at_once_and_a_websocket_gets_1001():
    server = LiveServer("--kv-cache-gib", "0.1", "--keep-alive-timeout", "60")
    try:
        idle = await trio.open_tcp_stream("127.0.0.1", server.port)
        await idle.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while b'{"status":"ok"}' not in reply:
            reply += await idle.receive_some(65536)
        async with open_websocket_url(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
            server.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                assert await idle.receive_some(65536) == b""  # not after its 60 s keep-alive
                with pytest.raises(ConnectionClosed) as raised:
                    await ws.get_message()
        assert raised.value.reason.code == 1001
        await idle.aclose()
        with trio.fail_after(15):
            while server.proc.poll() is None:
                await trio.sleep(0.05)
        assert server.proc.returncode == 0, server.output()
    finally:
        server.stop()
