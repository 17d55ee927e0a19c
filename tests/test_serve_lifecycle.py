"""The serve loop's own promises: a crashed engine takes the server down with it, and a
connection that fails takes nothing but itself."""

import argparse
import logging
import socket
import threading
from types import SimpleNamespace

import httpx
import pytest
import trio

from app.engine import Engine, EngineConfig, GenerationParams
from app.serve import serve
from app.server.state import ServerState
from app.server.http.connection import Connection
from app.server.http.http1 import Http1Protocol
from app.server.limits import Limits
from fake_runner import FakeRunner
from live_server import free_port
from hypercorn.events import RawData
from model.tokenizer import Tokenizer


def tiny_setup(tiny_dir):
    """An engine on the fake runner, the server state for it, and serve()'s arguments."""
    tok = Tokenizer(tiny_dir)
    engine = Engine(FakeRunner(16, 4, vocab=tok.vocab_size), tok, EngineConfig(max_model_len=64))
    state = ServerState(model_name="tiny", tokenizer=tok, max_model_len=64)
    return engine, state, argparse.Namespace(host="127.0.0.1", port=free_port(), shutdown_timeout=1.0,
                                             ssl_certfile=None, ssl_keyfile=None)


async def test_a_crashed_engine_stops_the_server(tiny_dir):
    engine, state, args = tiny_setup(tiny_dir)
    port = args.port

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    async def crash_when_up():
        with trio.fail_after(30):
            while True:
                try:
                    r = await trio.to_thread.run_sync(lambda: httpx.get(f"http://127.0.0.1:{port}/health"))
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.05)
        engine.planner.schedule = broken_schedule
        engine.submit([5, 6, 7], GenerationParams())  # wakes the tick, which now crashes

    with pytest.raises(BaseException) as raised, trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(crash_when_up)
            await serve(state, args, lambda: engine)
    assert "scheduler bug" in repr(raised.value)
    with pytest.raises(httpx.HTTPError):  # nothing listens any more
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


async def test_health_is_503_while_the_model_loads(tiny_dir):
    engine, state, args = tiny_setup(tiny_dir)
    port = args.port
    loaded = threading.Event()

    def slow_load():
        assert loaded.wait(30)
        return engine

    def get(path):
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, state, args, slow_load)
        with trio.fail_after(30):
            while True:
                try:
                    r = await trio.to_thread.run_sync(get, "/health")
                    break
                except httpx.HTTPError:
                    await trio.sleep(0.05)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = await trio.to_thread.run_sync(get, "/v1/models")
        assert r.status_code == 503 and r.headers["Retry-After"]
        loaded.set()
        with trio.fail_after(30):
            while (await trio.to_thread.run_sync(get, "/health")).status_code != 200:
                await trio.sleep(0.05)
        assert (await trio.to_thread.run_sync(get, "/v1/models")).json()["data"][0]["id"] == "tiny"
        nursery.cancel_scope.cancel()


class PanicException(BaseException):
    """As pyo3 raises a Rust panic (tokenizers, llguidance): a BaseException, known by its name."""


@pytest.mark.parametrize("error", [RuntimeError("a protocol library bug"), PanicException("a native panic")],
                         ids=["exception", "native-panic"])
async def test_a_connection_that_fails_inside_the_protocol_is_closed_alone(tiny_dir, monkeypatch, caplog, error):
    """Whatever escapes the protocol code (here an injected bug, or a native library's panic,
    which is no Exception) closes that connection, is logged once with the peer's address and
    counted; the server and other connections go on."""
    engine, state, args = tiny_setup(tiny_dir)
    url = f"http://127.0.0.1:{args.port}"
    handle = Http1Protocol.handle

    async def buggy_handle(self, event):
        if isinstance(event, RawData) and b"X-Boom" in event.data:
            raise error
        await handle(self, event)

    monkeypatch.setattr(Http1Protocol, "handle", buggy_handle)

    def bad_request() -> tuple[str, bytes]:
        with socket.create_connection(("127.0.0.1", args.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Boom: 1\r\n\r\n")
            return "%s:%d" % s.getsockname(), s.recv(1000)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, state, args, lambda: engine)
        with httpx.Client(base_url=url, timeout=10) as good:  # one keep-alive connection throughout
            with trio.fail_after(30):
                while True:
                    try:
                        if (await trio.to_thread.run_sync(good.get, "/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.05)
            with caplog.at_level(logging.WARNING, logger="spool.connection"):
                peer, reply = await trio.to_thread.run_sync(bad_request)
                assert reply == b""  # closed, with nothing half-written
                with trio.fail_after(10):
                    while not state.connections.closed["error"]:
                        await trio.sleep(0.01)
            failures = [r for r in caplog.records if r.name == "spool.connection"]
            assert len(failures) == 1 and peer in failures[0].getMessage(), [r.getMessage() for r in failures]
            assert state.connections.closed["error"] == 1
            assert (await trio.to_thread.run_sync(good.get, "/health")).status_code == 200
            r = await trio.to_thread.run_sync(lambda: good.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        nursery.cancel_scope.cancel()


async def test_a_write_and_the_close_never_meet_on_the_socket():
    """The close waits for the write in progress, so the peer gets every byte and then the EOF.
    Hypercorn's TCPServer sent the EOF outside its send lock: trio.BusyResourceError."""
    ours, theirs = trio.socket.socketpair()
    conn = Connection(trio.SocketStream(ours), SimpleNamespace(limits=Limits(send_timeout=10)))
    payload = b"x" * 20_000_000  # far more than the socket buffers: the write blocks until read
    received = 0

    async def slow_reader():
        nonlocal received
        await trio.sleep(0.2)
        while data := await theirs.recv(1 << 20):
            received += len(data)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_reader)
            nursery.start_soon(conn.write, payload)
            await trio.sleep(0.05)
            await conn.close("done")
    assert received == len(payload) and conn.reason == "done"


async def test_a_peer_that_stops_reading_is_dropped_after_the_send_timeout():
    ours, theirs = trio.socket.socketpair()
    conn = Connection(trio.SocketStream(ours), SimpleNamespace(limits=Limits(send_timeout=0.5)))
    with trio.fail_after(10):
        await conn.write(b"x" * 20_000_000)  # nobody reads
    assert conn.reason == "send_timeout" and conn.write_closed
    theirs.close()
