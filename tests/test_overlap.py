"""The engine's overlapped step loop, on a fake device runner: launch() queues a step and returns,
collect() waits for the "device". The loop must launch step N+1 before it waits for step N, and
keep the planner's semantics: every request gets the tokens it gets alone, stops one step late
send nothing past the stop, aborts and failures end the right requests, and no block is lost.
(The planner's invariants under random interleavings run in this mode too, in
test_scheduler_properties.py; the same loop on the CUDA kernels is in test_cuda_graphs.py.)"""

import time

import pytest
import trio

from app.engine import Engine, EngineConfig, GenerationParams
from fake_runner import FakeRunner
from model.tokenizer import Tokenizer
from test_engine import GREEDY, collect, prompt, tokens


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


class DeviceRunner(FakeRunner):
    """Records launches and collects in order; collect takes `device_time` (a device finishing
    the step) and fails for the steps in fail_collects."""

    def __init__(self, *args, device_time: float = 0.002, **kw):
        super().__init__(*args, overlaps=True, **kw)
        self.device_time = device_time
        self.events: list[tuple[str, int]] = []
        self.fail_collects: set[int] = set()

    def launch(self, plan):
        sampled = super().launch(plan)
        self.events.append(("launch", self.steps))
        return self.steps, sampled

    def collect(self, launched):
        step, sampled = launched
        time.sleep(self.device_time)
        self.events.append(("collect", step))
        if step in self.fail_collects:
            raise RuntimeError("the device step failed")
        return sampled


def make(tok, num_blocks=64, **kw):
    runner = DeviceRunner(num_blocks, 4, vocab=tok.vocab_size, **kw)
    return runner, Engine(runner, tok, EngineConfig(max_model_len=1024, max_seqs=8))


async def run_all(engine, requests):
    """Submit (prompt, params) pairs at once; each one's frames."""
    results = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)

        async def one(i, ids, params):
            _, recv = engine.submit(ids, params)
            results[i] = await collect(recv)

        async with trio.open_nursery() as clients:
            for i, (ids, params) in enumerate(requests):
                clients.start_soon(one, i, ids, params)
        nursery.cancel_scope.cancel()
    return [results[i] for i in range(len(requests))]


async def test_the_next_step_is_launched_before_the_last_one_is_awaited(tok):
    runner, engine = make(tok)
    requests = [(prompt(5 + i, i), GenerationParams(GREEDY, max_tokens=20)) for i in range(4)]
    results = await run_all(engine, requests)
    for (ids, _), frames in zip(requests, results):
        assert tokens(frames) == runner.expected(ids, 20) and frames[-1].finish_reason == "length"
    order = runner.events
    overlapped = sum(event == "launch" and order[i + 1] == ("collect", k - 1)
                     for i, (event, k) in enumerate(order[:-1]))  # launch N+1, then collect N
    assert overlapped >= 18, order  # in steady decode, every step
    assert runner.ahead_rows >= 4 * 17
    assert engine.status()["kv_blocks_used"] == 0 and not engine.planner.in_flight


async def test_a_stop_found_one_step_late_sends_nothing_past_it(tok):
    """The runner computes one more row for a request after the step that sampled its stop token;
    that row's token is dropped, and the request ends exactly where it would alone."""
    runner, engine = make(tok)
    ids = prompt(7, 3)
    stop_at = runner.expected(ids, 12)[5]
    params = GenerationParams(GREEDY, max_tokens=12, stop_token_ids=(stop_at,))
    (frames,) = await run_all(engine, [(ids, params)])
    want = runner.expected(ids, 12, stop_ids=(stop_at,))
    assert tokens(frames) == want and frames[-1].finish_reason == "stop" and frames[-1].stop_reason == stop_at
    rows = sum(row == ["req-0"] for row in runner.rows_seen)
    assert rows == len(want) + 1  # the prefill, a decode row per token after the first, and one dropped
    assert engine.status()["kv_blocks_used"] == 0


async def test_an_abort_while_steps_are_in_flight_cancels_and_frees(tok):
    runner, engine = make(tok, device_time=0.005)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        rid, recv = engine.submit(prompt(9, 1), GenerationParams(GREEDY, max_tokens=500, ignore_eos=True))
        other, other_recv = engine.submit(prompt(6, 2), GenerationParams(GREEDY, max_tokens=30))
        frames = []
        async for frame in recv:
            frames.append(frame)
            if len(tokens(frames)) >= 10:
                engine.abort(rid)
            if frame.finish_reason is not None:
                break
        assert frames[-1].finish_reason == "cancelled" and tokens(frames) == runner.expected(prompt(9, 1), 500)[
            :len(tokens(frames))]
        rest = await collect(other_recv)
        assert tokens(rest) == runner.expected(prompt(6, 2), 30)
        while engine.planner.has_work or engine.planner.in_flight:
            await trio.sleep(0.01)
        assert engine.status()["kv_blocks_used"] == 0
        nursery.cancel_scope.cancel()


async def test_a_step_that_fails_on_the_device_ends_its_rows_and_the_engine_serves_on(tok):
    runner, engine = make(tok)
    runner.fail_collects = {4}
    requests = [(prompt(5 + i, i), GenerationParams(GREEDY, max_tokens=12)) for i in range(3)]
    results = await run_all(engine, requests)
    assert all(f[-1].finish_reason == "error" and "the device step failed" in f[-1].error for f in results)
    (frames,) = await run_all(engine, [(prompt(8, 9), GenerationParams(GREEDY, max_tokens=6))])
    assert tokens(frames) == runner.expected(prompt(8, 9), 6)
    assert engine.status()["kv_blocks_used"] == 0 and not engine.planner.in_flight


async def test_a_row_that_needs_its_last_token_on_the_host_waits_a_step(tok):
    """A request on its last token is not planned ahead: no row past max_tokens is computed."""
    runner, engine = make(tok)
    ids = prompt(6, 4)
    (frames,) = await run_all(engine, [(ids, GenerationParams(GREEDY, max_tokens=5))])
    assert tokens(frames) == runner.expected(ids, 5)
    assert sum(row == ["req-0"] for row in runner.rows_seen) == 5
