"""The engine's planner and output processor with a fake runner: admission, blocks, aborts,
preemption, stops, failures."""

import pytest

from app.engine.planner import MIN_CHUNK
from app.engine.request import State
from app.engine.errors import EngineError
from engine_harness import Harness
from fake_runner import FakeRunner
from model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


def prompt(n, seed=0):
    return [3 + (seed * 7 + i * 13) % 390 for i in range(n)]


def make(tok, num_blocks=64, block_size=4, **config):
    runner = FakeRunner(num_blocks, block_size, vocab=tok.vocab_size, eos_id=tok.hf.token_to_id("<|im_end|>"))
    return runner, Harness(runner, tok, **config)


def test_outputs_are_the_expected_tokens_and_usage(tok):
    runner, h = make(tok)
    a = h.submit(prompt(10), max_tokens=7)
    b = h.submit(prompt(5, 1), max_tokens=3)
    h.run()
    assert h.tokens(a) == runner.expected(prompt(10), 7)
    assert h.tokens(b) == runner.expected(prompt(5, 1), 3)
    final = h.final(a)
    assert final.finish_reason == "length" and final.usage.prompt_tokens == 10 and final.usage.completion_tokens == 7
    assert h.pool.used == 0


def test_fifo_is_never_skipped(tok):
    runner, h = make(tok, num_blocks=12, block_size=4, max_seqs=8)
    first = h.submit(prompt(30), max_tokens=6)  # 8 blocks of 12
    big = h.submit(prompt(20, 1), max_tokens=2)  # needs 5: must wait for `first`
    small = h.submit(prompt(3, 2), max_tokens=2)  # would fit now, but is behind `big`
    admitted = []
    while h.planner.has_work:
        h.tick()
        for rid in (first, big, small):
            request = h.planner.queues.requests.get(rid)
            if rid not in admitted and (request is None or request.schedule.state is not State.WAITING):
                admitted.append(rid)
    assert admitted == [first, big, small]


def test_idle_engine_holds_zero_blocks(tok):
    runner, h = make(tok)
    for i in range(5):
        h.submit(prompt(9 + i, i), max_tokens=5)
    h.run()
    assert h.pool.used == 0 and h.pool.available == h.pool.num_blocks
    assert len(runner.released) == len(set(runner.released)) == 5


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
@pytest.mark.parametrize("spill", [0, 64])
def test_abort_in_every_state_returns_blocks_and_sends_one_final(tok, state, spill):
    runner, h = make(tok, num_blocks=10, block_size=4, prefill_chunk=4, max_seqs=4, swap_blocks=spill)
    older = h.submit(prompt(12), max_tokens=30)
    victim = h.submit(prompt(13, 1), max_tokens=30)
    waiting = h.submit(prompt(4, 2), max_tokens=30)
    target = {"waiting": waiting, "prefilling": victim, "decoding": older, "preempted": victim}[state]
    for _ in range(200):
        request = h.planner.queues.requests.get(target)
        if request is not None and request.schedule.state.value == state:
            break
        h.tick()
    else:
        pytest.fail(f"never reached {state}")
    h.planner.abort(target)
    h.tick()
    assert h.final(target).finish_reason == "cancelled"
    assert target not in h.planner.queues.requests
    h.run()
    assert h.pool.used == 0
    for rid in (older, victim, waiting):
        h.final(rid)
    assert sorted(runner.released) == sorted([older, victim, waiting])  # once each: the sampler's slots


def test_abort_before_the_request_arrives_is_carried(tok):
    runner, h = make(tok)
    h.planner.abort("early")
    h.tick()
    rid = h.submit(prompt(8), request_id="early", max_tokens=20)
    h.tick()
    assert h.final(rid).finish_reason == "cancelled" and h.tokens(rid) == []
    assert "early" not in h.planner.aborts


def test_an_abort_that_arrives_during_the_step_that_finishes_the_request_is_dropped(tok):
    runner, h = make(tok)
    rid = h.submit(prompt(5), max_tokens=1)
    step = runner.step

    def step_and_abort(plan):
        h.planner.abort(rid)  # the client leaves while the forward pass runs
        return step(plan)

    runner.step = step_and_abort
    h.tick()
    assert h.final(rid).finish_reason == "length"
    assert rid not in h.planner.aborts  # not kept pending forever


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "spill"])
def test_preemption_neither_repeats_nor_skips_a_token(tok, swap_blocks):
    runner, h = make(tok, num_blocks=16, block_size=4, swap_blocks=swap_blocks, immunity_tokens=4)
    prompts = [prompt(6 + i, i) for i in range(5)]
    rids = [h.submit(p, max_tokens=14) for p in prompts]
    h.run()
    assert h.stats.preemptions > 0
    for rid, p in zip(rids, prompts):
        assert h.tokens(rid) == runner.expected(p, 14), rid
        assert h.final(rid).finish_reason == "length"
    assert h.pool.used == 0 and h.planner.preemption.swap_used == 0


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "spill"])
def test_a_victim_that_needs_the_whole_pool_resumes_and_finishes(tok, swap_blocks):
    runner, h = make(tok, num_blocks=4, block_size=4, immunity_tokens=0, swap_blocks=swap_blocks,
                     prefix_caching=False)
    small = h.submit(prompt(3), max_tokens=4)
    big = h.submit(prompt(11, 1), max_tokens=4)  # 14 tokens: fits the 16-slot pool on its own
    h.run()  # at 13 tokens it needs its 4th block while `small` holds one, and preempts itself
    assert h.stats.preemptions == 1
    assert h.final(big).finish_reason == "length" and h.tokens(big) == runner.expected(prompt(11, 1), 4)
    assert h.final(small).finish_reason == "length"


def test_a_victim_that_can_never_fit_gets_an_error(tok):
    runner, h = make(tok, num_blocks=4, block_size=4, max_model_len=64)
    rid = h.submit(prompt(5), max_tokens=40)  # fits at submit, outgrows the 16-token pool
    h.run()
    final = h.final(rid)
    assert final.finish_reason == "error" and "KV cache" in final.error
    # 16 slots hold the prompt and 11 tokens; the 12th was sampled but has no slot to feed it
    assert h.tokens(rid) == runner.expected(prompt(5), 16 - 5 + 1)
    assert h.pool.used == 0


def test_runner_failure_fails_that_step_and_the_engine_serves_on(tok):
    runner, h = make(tok)
    a = h.submit(prompt(6), max_tokens=10)
    b = h.submit(prompt(7, 1), max_tokens=10)
    runner.fail_steps = {3}
    h.run()
    assert h.final(a).finish_reason == "error" and "injected" in h.final(a).error
    assert h.final(b).finish_reason == "error"
    c = h.submit(prompt(8, 2), max_tokens=5)
    h.run()
    assert h.final(c).finish_reason == "length" and h.tokens(c) == runner.expected(prompt(8, 2), 5)
    assert h.pool.used == 0


def script_for(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("span", [2, 3])
def test_stop_strings_split_across_tokens(tok, span):
    runner, h = make(tok)
    script = script_for(tok, "The capital of France is Paris. Hello")
    pieces = [tok.decode([t]) for t in script]
    # a stop that starts inside piece 3 and ends inside piece 3 + span - 1
    middle = "".join(pieces[4:3 + span - 1])
    stop = pieces[3][-2:] + middle + pieces[3 + span - 1][:2]
    assert not any(stop in "".join(pieces[i:i + span - 1]) for i in range(len(pieces)))
    p = prompt(5)
    runner.scripts[tuple(p)] = script
    rid = h.submit(p, max_tokens=40, stop=(stop,))
    h.run()
    final = h.final(rid)
    full = tok.decode(script)
    assert h.text(rid) == full[:full.index(stop)]
    assert final.finish_reason == "stop" and final.stop_reason == stop


def test_held_back_text_is_released_when_no_stop_follows(tok):
    runner, h = make(tok)
    script = script_for(tok, "The capital of France")
    runner.scripts[tuple(prompt(5))] = script
    rid = h.submit(prompt(5), max_tokens=len(script), stop=("France is",))
    h.run()
    assert h.text(rid) == "The capital of France" and h.final(rid).finish_reason == "length"


def test_eos_set_stop_token_ids_ignore_eos_and_min_tokens(tok):
    runner, h = make(tok)
    eos = tok.hf.token_to_id("<|im_end|>")
    hello = script_for(tok, "Hello world")
    runner.scripts[tuple(prompt(4))] = hello + [eos, *hello]
    a = h.submit(prompt(4), max_tokens=30)
    b = h.submit(prompt(4), max_tokens=2 * len(hello) + 1, ignore_eos=True)
    c = h.submit(prompt(4), max_tokens=30, stop_token_ids=(hello[1],))
    h.run()
    assert h.text(a) == "Hello world" and h.final(a).finish_reason == "stop"
    assert h.final(b).finish_reason == "length" and h.text(b) == "Hello worldHello world"
    assert h.final(c).finish_reason == "stop" and h.final(c).stop_reason == hello[1]
    # min_tokens bans the end-of-generation set until it is reached
    d = h.submit(prompt(4), max_tokens=30, min_tokens=len(hello) + 2)
    h.run()
    assert eos not in h.tokens(d)[:len(hello) + 2]


def test_queue_cap_and_refusals(tok):
    from app.engine import Engine, EngineConfig, Overloaded

    runner = FakeRunner(8, 4, vocab=tok.vocab_size)
    engine = Engine(runner, tok, EngineConfig(max_model_len=64, max_queue=2))
    engine.submit(prompt(3), params())
    engine.submit(prompt(3), params())
    with pytest.raises(Overloaded):
        engine.submit(prompt(3), params())
    for bad, message in [([], "empty"), ([999], "vocabulary"), (prompt(64), "context"),
                         (prompt(40), "KV blocks")]:
        with pytest.raises(EngineError, match=message):
            engine.submit(bad, params())
    with pytest.raises(EngineError, match="max_tokens"):
        engine.submit(prompt(10), params(max_tokens=60))


def params(**kw):
    from app.engine import GenerationParams
    from model.sampling import SamplingParams

    return GenerationParams(sampling=SamplingParams(temperature=0.0), **kw)


def test_prefix_cache_hits_are_confirmed_and_counted(tok):
    runner, h = make(tok, num_blocks=32, block_size=4)
    shared = prompt(17)
    a = h.submit(shared, max_tokens=3)
    h.run()
    b = h.submit(shared[:16] + [5], max_tokens=3)
    h.run()
    assert h.final(b).usage.cached_tokens == 16
    assert h.tokens(b) == runner.expected(shared[:16] + [5], 3)
    assert h.stats.prefix_cache_hits == 16
    # a forced hash collision is caught by the token comparison
    pool = h.pool
    other = prompt(17, 5)
    key = (-1, tuple(other[:4]))
    block = pool.block_of[hash((-1, tuple(shared[:4])))]
    pool.block_of[hash(key)] = block  # an index entry that points at the wrong tokens
    assert pool.match_prefix(other) == []
    assert h.final(a).usage.cached_tokens == 0


def test_flushing_the_prefix_cache_forgets_only_unreferenced_blocks(tok):
    runner, h = make(tok, num_blocks=32, block_size=4)
    shared = prompt(17)
    h.submit(shared, max_tokens=3)
    h.run()
    pool = h.pool
    cached = len(pool.evictable)
    assert cached >= 4 and pool.flush() == cached
    assert not pool.evictable and not pool.key_of and not pool.block_of and pool.available == 32
    pool.assert_consistent({})
    again = h.submit(shared, max_tokens=3)
    h.run()
    assert h.final(again).usage.cached_tokens == 0 and h.tokens(again) == runner.expected(shared, 3)


@pytest.mark.parametrize("parent", ["evicted", "duplicate"])
def test_prefix_cache_never_chains_through_a_reused_parent_id(tok, parent):
    """A cached block's K/V depends on every token before it. Once its parent's id holds other
    tokens, the block must not be found behind that id (the fake runner checks the prefix)."""
    runner, h = make(tok, num_blocks=6 if parent == "evicted" else 8, block_size=2)
    if parent == "evicted":  # the parent is evicted and its id cached again for other tokens
        h.submit([3, 4, 5, 6, 7], max_tokens=1)
        h.run()
        h.submit([9] * 8, max_tokens=1)  # takes the free blocks, so [7, 7] evicts [3, 4]'s block
        h.submit([7, 7], max_tokens=1)
        h.run()
        reader = [7, 7, 5, 6, 9]
    else:  # two copies computed at once: the second's first block is never cached, its child is
        h.submit([3, 4, 5, 6, 7], max_tokens=1)
        h.submit([3, 4, 5, 6, 7], max_tokens=1)
        h.run()
        reader = [8, 9, 10, 11, 5, 6, 7]  # reuses that first block's id for [10, 11], then [5, 6]
        h.submit(reader, max_tokens=1)
        h.run()
    rid = h.submit(reader, max_tokens=2)
    h.run()
    assert h.final(rid).finish_reason == "length" and h.tokens(rid) == runner.expected(reader, 2)


def test_text_held_for_a_stop_string_is_released_when_eos_ends_it(tok):
    runner, h = make(tok)
    eos = tok.hf.token_to_id("<|im_end|>")
    script = script_for(tok, "Hello world")
    runner.scripts[tuple(prompt(4))] = script + [eos]
    rid = h.submit(prompt(4), max_tokens=30, stop=("world peace",))
    h.run()
    assert h.text(rid) == "Hello world"
    assert h.final(rid).finish_reason == "stop" and h.final(rid).stop_reason is None


@pytest.mark.parametrize("copy", ["load_blocks", "save_blocks"], ids=["reload", "spill"])
def test_a_failed_copy_to_or_from_the_spill_pool_falls_back_to_recompute(tok, copy):
    runner, h = make(tok, num_blocks=16, block_size=4, swap_blocks=64, immunity_tokens=4)
    failures = []

    def broken(block_ids, *data):
        failures.append(block_ids)
        raise RuntimeError("host copy lost")

    setattr(runner, copy, broken)
    prompts = [prompt(6 + i, i) for i in range(5)]
    rids = [h.submit(p, max_tokens=14) for p in prompts]
    h.run()
    assert failures and h.stats.preemptions > 0
    for rid, p in zip(rids, prompts):
        assert h.tokens(rid) == runner.expected(p, 14)
    assert h.pool.used == 0 and h.planner.preemption.swap_used == 0


def chunks_of(h, rid):
    """The prefill chunks request rid (max_tokens=1: no decode rows) was planned, as (start,
    tokens), one a step."""
    chunks, step = [], h.runner.step

    def recording(plan):
        chunks.extend((r.start_pos, len(r.token_ids)) for r in plan.rows if r.request_id == rid)
        return step(plan)
    h.runner.step = recording
    h.run()
    return chunks


def test_a_long_prompts_chunks_shrink_beside_streams_so_a_step_costs_the_same(tok):
    """A prompt token at position p costs 1 + p / break_even (its attention; p no more than a
    sliding window): beside decoding streams, each chunk of a 1,200-token prompt is as many
    tokens as fit prefill_beside_decode's cost, at least MIN_CHUNK; alone, the same prompt takes
    whole chunks of prefill_chunk; without a break-even (a runner that names none), chunks
    beside streams are prefill_beside_decode tokens whatever their position."""
    def run(break_even, streams):
        runner = FakeRunner(400, 4, vocab=tok.vocab_size)
        runner.prefill_break_even = break_even
        h = Harness(runner, tok, prefill_chunk=64, prefill_beside_decode=48, max_batched_tokens=256)
        for i in range(streams):
            h.submit(prompt(5, i), max_tokens=400)
        for _ in range(3 if streams else 0):
            h.tick()
        return h, chunks_of(h, h.submit(prompt(1200, 9), max_tokens=1))

    h, shrunk = run(100.0, streams=2)
    for start, n in shrunk:
        assert n == min(1200 - start, max(MIN_CHUNK, int(48 / (1 + start / 100)))), (start, n)
    assert shrunk[0][1] == 48 and shrunk[-2][1] == MIN_CHUNK and sum(n for _, n in shrunk) == 1200
    h.planner.tables.window = 200
    assert h.planner.token_cost(150) == 2.5 and h.planner.token_cost(5000) == 3.0
    assert all(n == min(64, 1200 - start) for start, n in run(100.0, streams=0)[1])
    assert all(n == min(48, 1200 - start) for start, n in run(0.0, streams=2)[1])


def test_the_prefill_beside_decode_default_follows_the_backend():
    """128 tokens on the CPU, a whole chunk on a GPU, the flag over either; 0 is refused."""
    from app.cli import parse
    from app.flags import prefill_beside_decode
    from app.serve import validate_flags

    _, args, _ = parse(["serve"], environ={})
    assert prefill_beside_decode(args, "numba") == 128 and prefill_beside_decode(args, "cuda") == 0
    _, args, _ = parse(["serve", "--prefill-beside-decode", "32"], environ={})
    assert prefill_beside_decode(args, "cuda") == 32
    args.prefill_beside_decode = 0
    with pytest.raises(ValueError, match="--prefill-beside-decode must be at least 1"):
        validate_flags(args)
