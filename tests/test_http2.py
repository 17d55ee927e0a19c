"""HTTP/2 clients against a live server: Spool speaks HTTP/1.1 only and refuses HTTP/2 with a
GOAWAY (HTTP_1_1_REQUIRED), whatever the client does meanwhile; SGLang's router, whose
start-up gRPC probe over HTTP/2 used to kill the server, registers it 20 times in a row."""

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import httpx
import pytest
import trio

from live_server import LiveServer, free_port

FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"
GRPC_HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
                (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers")]


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--kv-cache-gib", "0.1", "--max-seqs", "8")
    yield s
    assert s.stop() == 0, s.output()


def h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn


async def read_events(stream, conn) -> list:
    """Every HTTP/2 event the server sends until it closes the connection."""
    events = []
    with trio.fail_after(10):
        while data := await stream.receive_some(65536):
            events += conn.receive_data(data)
    return events


async def test_http2_prior_knowledge_gets_goaway_http_1_1_required(server):
    before = server.closed("http2")
    conn = h2_client()
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    conn.send_headers(1, GRPC_HEADERS)
    conn.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)
    await stream.send_all(conn.data_to_send())
    events = await read_events(stream, conn)
    goaway = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED, events
    assert not [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    await stream.aclose()
    server.wait_closed("http2", before + 1, timeout=10)
    server.assert_serving()


async def h2_chaos_client(port: int, rng: random.Random) -> None:
    """gRPC-style POSTs and streamed chats on several HTTP/2 streams; read a random number of
    frames of the reply, then a reset, a GOAWAY, an abrupt close or a half-close."""
    chat = (b'{"messages": [{"role": "user", "content": "Count to one hundred"}], "stream": true,'
            b' "max_tokens": 64, "ignore_eos": true}')
    conn = h2_client()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    for sid in range(1, 2 * rng.randint(1, 4), 2):
        if rng.random() < 0.3:
            conn.send_headers(sid, GRPC_HEADERS)
            conn.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
        else:
            conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", "/v1/chat/completions"),
                                    (":authority", "127.0.0.1"), ("content-type", "application/json")])
            conn.send_data(sid, chat, end_stream=True)
    try:
        await stream.send_all(conn.data_to_send())
        frames, want = 0, rng.randint(0, 6)
        with trio.move_on_after(5):
            while frames < want and (data := await stream.receive_some(65536)):
                frames += len(conn.receive_data(data))
                await stream.send_all(conn.data_to_send())
        await trio.sleep(rng.random() * 0.03)
        ending = rng.choice(["reset", "goaway", "close", "half-close"])
        if ending == "reset":
            conn.reset_stream(1)
            await stream.send_all(conn.data_to_send())
        elif ending == "goaway":
            conn.close_connection()
            await stream.send_all(conn.data_to_send())
        elif ending == "half-close":
            await stream.send_eof()
        await trio.sleep(rng.random() * 0.05)
    except (trio.BrokenResourceError, h2.exceptions.ProtocolError):
        pass  # the server had already closed: fine
    await stream.aclose()


async def test_http2_clients_that_reset_and_close_at_random_moments(server):
    """Four such clients at a time, 40 times. Before Spool had its own connection layer, a
    GOAWAY that arrived while a response was being written killed the server within about 10
    rounds (trio.BusyResourceError from Hypercorn's HTTP/2 code)."""
    rng = random.Random(11)
    for round_ in range(40):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(h2_chaos_client, server.port, random.Random(rng.random()))
        assert server.proc.poll() is None, f"round {round_} killed the server:\n{server.output()}"
        r = await trio.to_thread.run_sync(lambda: httpx.get(server.url + "/health", timeout=5))
        assert r.status_code == 200
    server.assert_serving()


@pytest.mark.skipif(not list(FIXTURES.glob("grpc-health-probe-*.bin")), reason="no captured probes in shared/")
async def test_the_captured_router_probes_replayed_in_pieces(server):
    rng = random.Random(5)
    for path in sorted(FIXTURES.glob("grpc-health-probe-*.bin")) * 10:
        probe = path.read_bytes()
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        pos = 0
        while pos < len(probe):
            step = rng.randint(1, 64)
            await stream.send_all(probe[pos:pos + step])
            pos += step
            await trio.sleep(rng.random() * 0.002)
        events = await read_events(stream, h2_client())  # the probe carried the client's preface
        assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events
        await stream.aclose()
    server.assert_serving()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sglang-router") is None, reason="sglang-router is not installed (pip install sglang-router)")
def test_sglang_router_start_up_probe_20_times(server):
    """The router's real start-up: its gRPC probe over HTTP/2, then HTTP; after each, the
    worker is registered, and Spool is alive and answers through the router."""
    before = server.closed("http2")
    for attempt in range(20):
        port, metrics_port = free_port(), free_port()
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-router-{port}.log"
        with open(log_path, "w") as log:
            router = subprocess.Popen(
                ["sglang-router", "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", server.url,
                 "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "Activated 1 worker" not in log_path.read_text():
                assert router.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, f"attempt {attempt}: no worker registered\n{log_path.read_text()}"
                time.sleep(0.1)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
        finally:
            router.send_signal(signal.SIGINT)
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        server.assert_serving()
    server.wait_closed("http2", before + 20, timeout=10)  # every start-up probed over HTTP/2, and was refused
