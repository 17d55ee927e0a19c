"""The prefix cache's host tier (app/engine/host_tier.py): a finished turn's cached blocks that
other requests crowd out of the device go to the host spill pool, and the next turn sharing the
prefix reloads them instead of computing them again. The fake runner (whose K/V names the
prefix it was computed under) catches any wrong hit; the tiny model shows the same greedy
tokens as a run without pressure; the pool's invariants are checked after every tick."""

import pytest

from app.engine.host_tier import HostDrop, HostSave, HostTier
from engine_harness import Harness
from fake_runner import FakeRunner
from model.runner import ModelRunner
from model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def prompt(n, seed=0):
    return [3 + (seed * 7 + i * 13) % 390 for i in range(n)]


def count_fed(runner) -> dict:
    """Per request id, how many tokens its rows fed (prefill chunks and decode tokens)."""
    fed = {}
    launch = runner.launch

    def counting(plan):
        for row in plan.rows:
            fed[row.request_id] = fed.get(row.request_id, 0) + len(row.token_ids)
        return launch(plan)

    runner.launch = counting
    return fed


def two_turns(runner, h, pressure=3, turn_len=33, fillers_len=40, max_tokens=3):
    """Turn one, then `pressure` unrelated requests that need the whole device pool, then turn
    two: turn one's prompt, its reply and a few new tokens. Returns turn two's id and prompt."""
    first = prompt(turn_len)
    a = h.submit(first, max_tokens=max_tokens)
    h.run()
    for k in range(pressure):
        h.submit(prompt(fillers_len, seed=k + 1), max_tokens=2)
        h.run()
    second = first + h.tokens(a) + prompt(6, seed=9)
    return h.submit(second, max_tokens=max_tokens), second


def test_an_evicted_prefix_comes_back_from_the_host(tok):
    runner = FakeRunner(num_blocks=16, block_size=4)
    fed = count_fed(runner)
    h = Harness(runner, tok, swap_blocks=32)
    b, second = two_turns(runner, h)
    h.run()
    cached = h.final(b).usage.cached_tokens
    assert cached == 32 and h.stats.prefix_cache_host_hits == 32  # turn one's 8 full prompt blocks
    assert fed[b] == len(second) - cached + 2  # the new tokens, then 2 decode tokens
    assert h.tokens(b) == runner.expected(second, 3)
    assert h.pool.used == 0 and h.pool.host.used == len(h.pool.host.entries) <= 32


def test_without_swap_space_the_prefix_is_computed_again(tok):
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok)
    b, second = two_turns(runner, h)
    h.run()
    assert h.pool.host is None
    assert h.final(b).usage.cached_tokens == 0 and h.stats.prefix_cache_host_hits == 0
    assert h.tokens(b) == runner.expected(second, 3)


@pytest.mark.parametrize("swap_blocks", [1, 3, 7])
def test_a_host_pool_too_small_for_everything_keeps_what_fits(tok, swap_blocks):
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok, swap_blocks=swap_blocks)
    b, second = two_turns(runner, h)
    h.run()
    assert h.tokens(b) == runner.expected(second, 3)
    assert h.final(b).usage.cached_tokens <= 4 * swap_blocks
    assert len(h.pool.host.entries) <= swap_blocks


def test_a_failed_load_computes_the_tokens_instead(tok):
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok, swap_blocks=32)
    load = runner.load_blocks
    calls = []

    def failing(block_ids, data):
        calls.append(block_ids)
        if len(calls) == 3:
            raise RuntimeError("the copy failed")
        load(block_ids, data)

    runner.load_blocks = failing
    b, second = two_turns(runner, h)
    h.run()
    assert len(calls) >= 3
    assert h.tokens(b) == runner.expected(second, 3)
    usage = h.final(b).usage
    assert usage.cached_tokens == h.stats.prefix_cache_hits and h.stats.prefix_cache_host_hits == 0


def test_a_failed_save_leaves_nothing_to_find(tok):
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok, swap_blocks=32)
    save = runner.save_blocks
    saved = []

    def failing(block_ids):
        saved.append(block_ids)
        if len(saved) % 2:
            raise RuntimeError("no host memory")
        return save(block_ids)

    runner.save_blocks = failing
    b, second = two_turns(runner, h)
    h.run()
    assert h.tokens(b) == runner.expected(second, 3)
    assert all(e.data is not None for e in h.pool.host.entries.values())


def test_flushing_the_prefix_cache_empties_the_host_tier_too(tok):
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok, swap_blocks=32)
    b, second = two_turns(runner, h)
    held, cached = len(h.pool.host.entries), len(h.pool.evictable)
    assert held >= 8 and h.pool.flush() == cached + held
    assert not h.pool.host.entries and h.pool.host.used == 0
    h.run()  # the copies are dropped at the next tick
    assert h.final(b).usage.cached_tokens == 0 and h.tokens(b) == runner.expected(second, 3)


def test_turns_under_preemption_and_a_shared_host_pool_stay_right(tok):
    """Many turns at once in a pool too small for them: spills and the host tier share the
    host pool, and every request gets the tokens it would alone."""
    runner = FakeRunner(num_blocks=20, block_size=4)
    h = Harness(runner, tok, swap_blocks=12, immunity_tokens=2, max_seqs=4)
    firsts = [prompt(14 + 3 * k, seed=k) for k in range(4)]
    rids = [h.submit(p, max_tokens=8) for p in firsts]
    h.run()
    seconds = [p + h.tokens(r) + prompt(5, seed=20 + k) for k, (p, r) in enumerate(zip(firsts, rids))]
    again = [h.submit(p, max_tokens=8) for p in seconds]
    h.run()
    for rid, p in zip(again, seconds):
        assert h.tokens(rid) == runner.expected(p, 8), rid
    assert h.pool.used == 0 and h.planner.preemption.swap_used == 0


def test_spills_may_evict_host_entries_and_never_the_other_way():
    moves, spilled = [], [0]
    tier = HostTier(4, moves, lambda: spilled[0])
    for block in range(4):
        tier.offer(block, (-1, (block,)), (block, 1))
    assert [type(m) for m in moves] == [HostSave] * 4 and tier.used == 4
    tier.offer(9, (-1, (9,)), (9, 1))  # full: the least recently used entry makes way
    assert isinstance(moves[4], HostDrop) and moves[4].entry.key == (-1, (0,))
    assert tier.find((-1, (0,))) is None and tier.find((-1, (9,))) is not None
    assert tier.make_room(3)  # a spill evicts entries
    spilled[0] = 3
    assert len(tier.entries) == 1 and tier.used == 4
    assert not tier.make_room(2)  # never more than the pool
    tier.offer(10, (-1, (10,)), (10, 1))  # an eviction takes the last entry's place, never a spill's
    spilled[0] = 4
    tier.offer(11, (-1, (11,)), (11, 1))
    assert not tier.entries and tier.used == 4


def tiny_turns(path, tok, num_blocks, swap_blocks, pressure):
    """Two chat-like turns on the tiny model, with `pressure` unrelated prompts between them."""
    runner = ModelRunner.from_dir(path, num_blocks=num_blocks, block_size=4)
    fed = count_fed(runner)
    h = Harness(runner, tok, swap_blocks=swap_blocks, prefill_chunk=64)
    first = tok.encode("The capital of France is Paris. The capital of Italy is Rome. " * 2 + "Hello world!")
    a = h.submit(first, max_tokens=8, ignore_eos=True)
    h.run()
    for k in range(pressure):
        h.submit(tok.encode(f"Numbers: {k} 1 2 3 4 5 6 7 8 9 10 100 1000 def add(a, b): return a + b {k}"),
                 max_tokens=4, ignore_eos=True)
        h.run()
    second = first + h.tokens(a) + tok.encode(" How are you today?")
    b = h.submit(second, max_tokens=12, ignore_eos=True)
    h.run()
    assert h.pool.used == 0
    return h, h.tokens(b), h.final(b).usage.cached_tokens, fed[b] - 11, len(second)


def test_the_tiny_model_reads_the_same_after_a_reload(tiny_dir, tok):
    _, calm, calm_cached, _, length = tiny_turns(tiny_dir, tok, num_blocks=256, swap_blocks=0, pressure=0)
    h, tokens, cached, computed, _ = tiny_turns(tiny_dir, tok, num_blocks=24, swap_blocks=64, pressure=3)
    assert calm_cached >= 32 and cached == calm_cached
    assert h.stats.prefix_cache_host_hits > 0 and computed == length - cached
    assert tokens == calm
    _, recomputed, none_cached, _, _ = tiny_turns(tiny_dir, tok, num_blocks=24, swap_blocks=0, pressure=3)
    assert none_cached == 0 and recomputed == calm
    _, squeezed, _, _, _ = tiny_turns(tiny_dir, tok, num_blocks=24, swap_blocks=3, pressure=3)
    assert squeezed == calm


def test_a_reloaded_prefix_keeps_its_children_across_turns(tok):
    """Turn three finds turn two's blocks, the reloaded ones and those computed after them,
    wherever each sits by then: a reloaded block keeps the identity its children name."""
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok, swap_blocks=64)
    b, second = two_turns(runner, h)
    h.run()
    for k in range(3):
        h.submit(prompt(40, seed=k + 5), max_tokens=2)
        h.run()
    third = second + h.tokens(b) + prompt(5, seed=11)
    c = h.submit(third, max_tokens=3)
    h.run()
    assert h.final(c).usage.cached_tokens == (len(second) + 2) // 4 * 4
    assert h.tokens(c) == runner.expected(third, 3)


def test_a_match_goes_on_from_the_host_into_the_device_and_back(tok):
    """Part of turn one is crowded out to the host, the rest stays on the device: turn two
    matches across both, and turn three, right after, finds turn one's device blocks again
    behind the reloaded ones (their parent's identity went with it)."""
    runner = FakeRunner(num_blocks=16, block_size=4)
    h = Harness(runner, tok, swap_blocks=32)
    first = prompt(33)
    a = h.submit(first, max_tokens=3)
    h.run()
    h.submit(prompt(41, seed=1), max_tokens=2)  # 11 blocks: 8 free, 3 of turn one's evicted
    h.run()
    assert len(h.pool.host.entries) == 3
    second = first + h.tokens(a) + prompt(6, seed=9)
    b = h.submit(second, max_tokens=3)
    h.run()
    assert h.final(b).usage.cached_tokens == 32 and h.stats.prefix_cache_host_hits == 12
    assert h.tokens(b) == runner.expected(second, 3)
    third = second + h.tokens(b) + prompt(5, seed=11)
    c = h.submit(third, max_tokens=3)
    h.run()
    assert h.final(c).usage.cached_tokens == (len(second) + 2) // 4 * 4
    assert h.tokens(c) == runner.expected(third, 3)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_spills_and_host_entries_share_the_gpu_spill_pool_slot_for_slot(tiny_dir, tok, caplog, backend):
    """The GPU's spill pool (on the CPU harness, or a GPU) with few slots, turns and preemption competing
    for them: every copy finds a free slot (the moves run in the order their room was counted),
    and the tokens are those of a run that recomputes everything."""
    from test_cuda_forward import cuda_ops

    results = []
    for swap_blocks in (0, 6):
        runner = ModelRunner.from_dir(tiny_dir, num_blocks=16, block_size=4, ops=cuda_ops(backend))
        if swap_blocks:
            runner.reserve_swap(swap_blocks)
        h = Harness(runner, tok, immunity_tokens=2, swap_blocks=swap_blocks, prefix_caching=bool(swap_blocks))
        firsts = [prompt(9 + 5 * k, seed=k) for k in range(3)]
        rids = [h.submit(p, max_tokens=10, ignore_eos=True) for p in firsts]
        h.run()
        seconds = [p + h.tokens(r) + prompt(3, seed=7 + k) for k, (p, r) in enumerate(zip(firsts, rids))]
        again = [h.submit(p, max_tokens=10, ignore_eos=True) for p in seconds]
        h.run()
        results.append([h.tokens(r) for r in rids + again])
    assert h.stats.preemptions > 0 and h.stats.prefix_cache_host_hits > 0
    assert results[0] == results[1]
    assert len(runner.swap.free) + len(h.pool.host.entries) == 6 and "could not be" not in caplog.text


async def test_the_engine_loop_runs_a_turn_whose_prefix_is_on_the_host(tok):
    """Alone in the engine, a request admitted with its prefix on the host is planned once
    its loads are done, in the same tick: the loop never idles with it waiting."""
    import trio

    from app.engine import Engine, EngineConfig, GenerationParams
    from model.sampling import SamplingParams

    runner = FakeRunner(num_blocks=16, block_size=4, vocab=tok.vocab_size)
    engine = Engine(runner, tok, EngineConfig(max_model_len=1024, swap_blocks=32, decode_log_interval=0))

    async def generate(ids, max_tokens):
        _, recv = engine.submit(ids, GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens))
        frames = []
        async for frame in recv:
            frames.append(frame)
            if frame.finish_reason is not None:
                break
        return [t for f in frames for t in f.token_ids], frames[-1].usage

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(20):
            first = prompt(33)
            reply, _ = await generate(first, 3)
            for k in range(3):
                await generate(prompt(40, seed=k + 1), 2)
            second = first + reply + prompt(6, seed=9)
            tokens, usage = await generate(second, 3)
        nursery.cancel_scope.cancel()
    assert usage.cached_tokens == 32 and engine.stats.prefix_cache_host_hits == 32
    assert tokens == runner.expected(second, 3)
