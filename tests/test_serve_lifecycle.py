"""The serve loop's own promises: a crashed engine takes the server down with it."""

import argparse

import httpx
import pytest
import trio

from app.engine import Engine, EngineConfig, GenerationParams
from app.serve import serve
from app.server.app import ServerState
from fake_runner import FakeRunner
from live_server import free_port
from model.tokenizer import Tokenizer


async def test_a_crashed_engine_stops_the_server(tiny_dir):
    tok = Tokenizer(tiny_dir)
    engine = Engine(FakeRunner(16, 4, vocab=tok.vocab_size), tok, EngineConfig(max_model_len=64))
    state = ServerState(engine=engine, tokenizer=tok, model_name="tiny", max_model_len=64)
    port = free_port()
    args = argparse.Namespace(host="127.0.0.1", port=port, shutdown_timeout=1.0)

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
            await serve(engine, state, args)
    assert "scheduler bug" in repr(raised.value)
    with pytest.raises(httpx.HTTPError):  # nothing listens any more
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
