"""The Trio engine around the planner and output processor: channels, the abort inbox, failures,
drain."""

import pytest
import trio

import app.engine.engine as engine_module
from app.engine import Draining, Engine, EngineConfig, GenerationParams
from fake_runner import FakeRunner
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def prompt(n, seed=0):
    return [3 + (seed * 7 + i * 13) % 390 for i in range(n)]


def make(tok, num_blocks=64, step_cost=0.0, **config):
    runner = FakeRunner(num_blocks, 4, vocab=tok.vocab_size, step_cost=step_cost)
    config.setdefault("max_model_len", 1024)
    return runner, Engine(runner, tok, EngineConfig(**config))


async def collect(recv):
    frames = []
    async for frame in recv:
        frames.append(frame)
        if frame.finish_reason is not None:
            return frames
    return frames


def tokens(frames):
    return [t for f in frames for t in f.token_ids]


async def test_concurrent_requests_stream_their_own_tokens(tok):
    runner, engine = make(tok)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        results = {}

        async def one(i):
            rid, recv = engine.submit(prompt(5 + i, i), GenerationParams(GREEDY, max_tokens=6 + i))
            results[i] = await collect(recv)

        async with trio.open_nursery() as clients:
            for i in range(6):
                clients.start_soon(one, i)
        for i, frames in results.items():
            assert tokens(frames) == runner.expected(prompt(5 + i, i), 6 + i)
            assert [f.finish_reason for f in frames].count("length") == 1
        assert engine.status()["kv_blocks_used"] == 0
        nursery.cancel_scope.cancel()


async def test_abort_from_another_task_mid_decode(tok):
    runner, engine = make(tok, step_cost=0.002)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        rid, recv = engine.submit(prompt(8), GenerationParams(GREEDY, max_tokens=500))
        frames = []
        async for frame in recv:
            frames.append(frame)
            if len(tokens(frames)) >= 5 and not any(f.finish_reason for f in frames):
                engine.abort(rid)
            if frame.finish_reason:
                break
        assert frames[-1].finish_reason == "cancelled"
        assert 5 <= len(tokens(frames)) < 500
        assert tokens(frames) == runner.expected(prompt(8), len(tokens(frames)))
        engine.abort(rid)  # an id already finished is ignored
        await trio.sleep(0.01)
        assert engine.status()["kv_blocks_used"] == 0
        nursery.cancel_scope.cancel()


async def test_abort_right_after_submit_takes_effect(tok):
    runner, engine = make(tok)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        rid, recv = engine.submit(prompt(8), GenerationParams(GREEDY, max_tokens=50))
        engine.abort(rid)
        frames = await collect(recv)
        assert [f.finish_reason for f in frames] == ["cancelled"] and tokens(frames) == [], frames
        nursery.cancel_scope.cancel()


async def test_runner_failure_fails_rows_and_serving_continues(tok):
    runner, engine = make(tok)
    runner.fail_steps = {2}
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        _, recv = engine.submit(prompt(6), GenerationParams(GREEDY, max_tokens=10))
        frames = await collect(recv)
        assert frames[-1].finish_reason == "error" and "injected runner failure" in frames[-1].error
        _, recv = engine.submit(prompt(6, 1), GenerationParams(GREEDY, max_tokens=4))
        frames = await collect(recv)
        assert frames[-1].finish_reason == "length" and tokens(frames) == runner.expected(prompt(6, 1), 4)
        nursery.cancel_scope.cancel()


async def test_a_client_that_stops_reading_is_aborted(tok, monkeypatch):
    monkeypatch.setattr(engine_module, "CHANNEL_FRAMES", 3)
    runner, engine = make(tok)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        rid, recv = engine.submit(prompt(6), GenerationParams(GREEDY, max_tokens=200))
        with trio.fail_after(5):
            while engine.status()["num_requests_running"] or engine.status()["num_requests_waiting"]:
                await trio.sleep(0.01)
        assert engine.stats.finished["cancelled"] == 1
        frames = await collect(recv)  # the reader that comes back still gets its final frame
        assert len(frames) == 4 and frames[-1].finish_reason == "cancelled"
        assert engine.status()["kv_blocks_used"] == 0
        nursery.cancel_scope.cancel()


async def test_drain_finishes_short_requests_and_cancels_long_ones(tok):
    runner, engine = make(tok, step_cost=0.003)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        _, short = engine.submit(prompt(5), GenerationParams(GREEDY, max_tokens=3))
        _, long = engine.submit(prompt(5, 1), GenerationParams(GREEDY, max_tokens=900))
        results = {}

        async def read(name, recv):
            results[name] = await collect(recv)

        nursery.start_soon(read, "short", short)
        nursery.start_soon(read, "long", long)
        await trio.sleep(0.02)
        with trio.fail_after(5):
            await engine.drain(grace=0.2)
        with pytest.raises(Draining):
            engine.submit(prompt(5), GenerationParams(GREEDY, max_tokens=3))
        await trio.sleep(0.01)
        assert results["short"][-1].finish_reason == "length"
        assert results["long"][-1].finish_reason == "cancelled"
        assert engine.status()["kv_blocks_used"] == 0
        nursery.cancel_scope.cancel()


async def test_status_lines_in_sglang_format(tok, caplog):
    runner, engine = make(tok, decode_log_interval=4)
    caplog.set_level("INFO", logger="spool.engine")
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        _, recv = engine.submit(prompt(9), GenerationParams(GREEDY, max_tokens=12))
        await collect(recv)
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Prefill batch. #new-seq: 1, #new-token: 9, #cached-token: 0, token usage: ")
               and line.endswith("#running-req: 1, #queue-req: 0") for line in lines)
    decode = [line for line in lines if line.startswith("Decode batch. #running-req: ")]
    assert decode and all("gen throughput (token/s): " in line for line in decode)
