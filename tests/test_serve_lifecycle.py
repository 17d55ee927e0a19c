"""The serve loop's own promises: a crashed engine takes the server down with it."""

import argparse
import threading

import httpx
import pytest
import trio

from app.engine import Engine, EngineConfig, GenerationParams
from app.serve import serve
from app.server.app import ServerState
from fake_runner import FakeRunner
from live_server import free_port
from model.tokenizer import Tokenizer


def tiny_setup(tiny_dir):
    """An engine on the fake runner, the server state for it, and serve()'s arguments."""
    tok = Tokenizer(tiny_dir)
    engine = Engine(FakeRunner(16, 4, vocab=tok.vocab_size), tok, EngineConfig(max_model_len=64))
    state = ServerState(model_name="tiny", tokenizer=tok, max_model_len=64)
    return engine, state, argparse.Namespace(host="127.0.0.1", port=free_port(), shutdown_timeout=1.0)


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
        engine.scheduler.schedule = broken_schedule
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
