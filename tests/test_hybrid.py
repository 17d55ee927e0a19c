"""Hybrid models (Qwen3.5's gated delta nets beside full attention) served: the state a request
carries in its slot is the same bits however its prompt is split into chunks and whatever rows
run beside it, and the engine's scheduling (batching, chunk sizes, preemption, aborts) never
changes what a request gets. Logits against transformers are in test_families.py."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from engine_harness import Harness
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from family_models import make_family  # noqa: E402

# the packed path is batch-invariant (integer GEMMs): its bits are held equal; NumPy's float32
# GEMMs (OpenBLAS) round by row count, and so do the CUDA harness's (cuBLAS's stand-in), so
# those agree to float32 rounding
BACKENDS = {"numpy": NumpyOps, "numba": lambda: NumbaOps("q8_0"), "cuda-harness": lambda: CudaOps(np, CpuLauncher())}


def same(backend, got, want):
    if backend == "numba":
        return np.array_equal(got, want)
    return np.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory, tiny_dir):
    """name -> the tiny random Qwen3.5 (or Qwen3.5-MoE) of tools/family_models.py, with the tiny
    model's tokenizer (400 tokens: every id the model's 256 can sample decodes)."""
    made = {}

    def get(name):
        if name not in made:
            path, _ = make_family(name, tmp_path_factory.mktemp(name))
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tiny_dir / file, path / file)
            made[name] = path
        return made[name]
    return get


@pytest.fixture(scope="module")
def hybrid_dir(hybrid_dirs):
    return hybrid_dirs("qwen3.5")


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


def runner_for(path, backend, slots=4):
    return ModelRunner.from_dir(path, num_blocks=64, block_size=4, ops=BACKENDS[backend](), state_slots=slots)


def state(runner, slot):
    """Every delta-net layer's state in slot, flat."""
    c = runner.cache
    return np.concatenate([a[slot].ravel() for a in (*c.conv, *c.recurrent) if a is not None])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_a_prompt_fed_whole_or_in_random_chunks_keeps_its_bits(hybrid_dirs, name, backend):
    """The state after the prompt and the logits after it: the same bits in one prefill and in
    random chunks (in another slot, under other blocks)."""
    runner = runner_for(hybrid_dirs(name), backend)
    ids = prompt(45)
    whole = runner.ops.to_host(runner.logits(StepPlan([Row("a", ids, 0, list(range(12)), True, state_slot=1)])))
    cuts = sorted(np.random.default_rng(3).choice(np.arange(1, len(ids)), 6, replace=False).tolist())
    table = list(range(63, 51, -1))
    for start, end in zip([0, *cuts], [*cuts, len(ids)]):
        row = Row("b", ids[start:end], start, table, sample=end == len(ids), state_slot=3)
        out = runner.logits(StepPlan([row]))
    assert same(backend, runner.ops.to_host(out), whole)
    assert same(backend, state(runner, 3), state(runner, 1))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_rows_beside_each_other_get_the_bits_they_get_alone(hybrid_dir, backend):
    """A prompt's chunk, a fresh prompt and a decode token in one step: each row's logits and
    state as when it runs alone."""
    def rows():
        return [Row("p", prompt(9, 1)[4:], 4, [0, 1, 2], True, state_slot=0),
                Row("f", prompt(13, 2), 0, [3, 4, 5, 6], True, state_slot=1),
                Row("d", [prompt(7, 3)[-1]], 6, [7, 8], True, state_slot=2)]

    def warm(runner):  # the first prompt's first 4 tokens, and the decode row's 6 before it
        runner.logits(StepPlan([Row("p", prompt(9, 1)[:4], 0, [0, 1, 2], state_slot=0)]))
        runner.logits(StepPlan([Row("d", prompt(7, 3)[:6], 0, [7, 8], state_slot=2)]))

    together = runner_for(hybrid_dir, backend)
    warm(together)
    batch = together.ops.to_host(together.logits(StepPlan(rows())))
    for i, row in enumerate(rows()):
        alone = runner_for(hybrid_dir, backend)
        warm(alone)
        assert same(backend, alone.ops.to_host(alone.logits(StepPlan([row])))[0], batch[i]), row.request_id
        assert same(backend, state(alone, row.state_slot), state(together, row.state_slot)), row.request_id


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_rejected_guess_leaves_the_state_of_plain_decoding(hybrid_dir, backend):
    """A row verifying three guesses, the first right and the second wrong: its state afterwards
    is the state after the input token and the kept guess, as two plain decode steps leave it
    (same bits on the packed path), and the next step's logits agree."""
    ids = prompt(11, 5)
    plain, guessed = runner_for(hybrid_dir, backend), runner_for(hybrid_dir, backend)
    table = list(range(6))
    t1 = plain.step(StepPlan([Row("a", ids, 0, table, True, state_slot=0)]))[0].token_id
    t2 = plain.step(StepPlan([Row("a", [t1], 11, table, True, state_slot=0)]))[0].token_id
    t3 = plain.step(StepPlan([Row("a", [t2], 12, table, True, state_slot=0)]))[0].token_id
    want = plain.ops.to_host(plain.logits(StepPlan([Row("a", [t3], 13, table, True, state_slot=0)])))
    guessed.step(StepPlan([Row("a", ids, 0, table, True, state_slot=1)]))
    wrong = (t3 + 1) % 256
    out = guessed.step(StepPlan([Row("a", [t1, t2, wrong, 7], 11, table, True, state_slot=1, num_draft=3)]))
    assert [o.token_id for o in out][:2] == [t2, t3]
    got = guessed.ops.to_host(guessed.logits(StepPlan([Row("a", [t3], 13, table, True, state_slot=1)])))
    assert same(backend, got, want)
    # the kept state, before the check step above wrote t3: compare from a fresh pair
    plain2, guessed2 = runner_for(hybrid_dir, backend), runner_for(hybrid_dir, backend)
    for r in (plain2, guessed2):
        r.step(StepPlan([Row("a", ids, 0, table, True, state_slot=0)]))
    plain2.step(StepPlan([Row("a", [t1], 11, table, True, state_slot=0)]))
    plain2.step(StepPlan([Row("a", [t2], 12, table, True, state_slot=0)]))
    guessed2.step(StepPlan([Row("a", [t1, t2, wrong, 7], 11, table, True, state_slot=0, num_draft=3)]))
    assert same(backend, state(guessed2, 0), state(plain2, 0))


def test_a_row_without_its_slot_is_refused(hybrid_dir):
    runner = runner_for(hybrid_dir, "numpy", slots=2)
    for row in (Row("a", [5, 6], 0, [0], True), Row("a", [5, 6], 0, [0], True, state_slot=2)):
        with pytest.raises(ValueError, match="state slot"):
            runner.logits(StepPlan([row]))
    with pytest.raises(ValueError, match="share a state slot"):
        runner.logits(StepPlan([Row("a", [5], 0, [0], True, state_slot=1), Row("b", [6], 0, [1], True, state_slot=1)]))


def generate(path, prompts, max_tokens=12, slots=4, num_blocks=64, seeds=None, abort=None, **config):
    runner = ModelRunner.from_dir(path, num_blocks=num_blocks, block_size=4, ops=NumbaOps("q8_0"), state_slots=slots)
    h = Harness(runner, Tokenizer(path), **config)
    assert h.planner.config.state_slots == slots and not h.pool.prefix_caching
    rids = []
    for i, p in enumerate(prompts):
        sampling = SamplingParams(temperature=0.0) if seeds is None else SamplingParams(temperature=1.0, seed=seeds[i])
        rids.append(h.submit(p, max_tokens=max_tokens, ignore_eos=True, sampling=sampling))
    if abort is not None:  # a request aborted once it has a token, while the others run
        while not h.tokens(rids[abort]):
            h.tick()
        h.engine.abort(rids[abort])
    h.run()
    assert h.pool.used == 0 and h.planner.tables.slots.used == 0
    return [h.tokens(r) for r in rids], h


PROMPTS = [prompt(n, seed) for n, seed in ((23, 10), (5, 11), (31, 12), (14, 13))]


@pytest.fixture(scope="module")
def alone(hybrid_dir):
    """Each prompt greedy and seeded, run alone with whole-prompt chunks."""
    return ([generate(hybrid_dir, [p], prefill_chunk=64)[0][0] for p in PROMPTS],
            [generate(hybrid_dir, [p], seeds=[i], prefill_chunk=64)[0][0] for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("config", [dict(prefill_chunk=7), dict(prefill_chunk=64, max_seqs=2),
                                    dict(prefill_chunk=5, slots=2, max_seqs=4)],
                         ids=["small-chunks", "two-at-once", "fewer-slots-than-seqs"])
def test_batching_and_chunking_change_nothing(hybrid_dir, alone, config):
    """Greedy and seeded requests together get what each gets alone; with fewer slots than
    --max-num-seqs, admission waits for a slot."""
    slots = config.pop("slots", 4)
    assert generate(hybrid_dir, PROMPTS, slots=slots, **config)[0] == alone[0]
    tokens, h = generate(hybrid_dir, PROMPTS, seeds=range(len(PROMPTS)), slots=slots, **config)
    assert tokens == alone[1]


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "spill"])
def test_preemption_keeps_or_recomputes_the_state(hybrid_dir, alone, swap_blocks):
    """A pool too small for every request at once: victims give their slot back and either
    recompute their state from their tokens or get it back from the host with their K/V (into
    another slot), and get what they get alone."""
    tokens, h = generate(hybrid_dir, PROMPTS, num_blocks=14, prefill_chunk=64, immunity_tokens=2,
                         swap_blocks=swap_blocks)
    assert h.stats.preemptions > 0
    assert tokens == alone[0]


def test_an_abort_frees_its_slot_and_harms_no_one(hybrid_dir, alone):
    tokens, _ = generate(hybrid_dir, PROMPTS, slots=2, abort=1, prefill_chunk=64)
    assert [t for i, t in enumerate(tokens) if i != 1] == [t for i, t in enumerate(alone[0]) if i != 1]
    assert 1 <= len(tokens[1]) < 12 and tokens[1] == alone[0][1][:len(tokens[1])]


@pytest.fixture(scope="module")
def echo_dir(hybrid_dir, tmp_path_factory):
    """The tiny Qwen3.5 with its LM head set to its embedding: its greedy tokens often repeat
    the token before (108 108 108 35 123 ... 117 117 117 74 114 114 ...), so that prompt lookup's
    guesses are kept at times and rejected at others."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path_factory.mktemp("qwen3.5-echo")
    for f in hybrid_dir.iterdir():
        shutil.copy(f, path / f.name)
    tensors = load_file(hybrid_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_speculation_changes_no_token(echo_dir, seeded):
    """Prompt lookup's guesses on a hybrid, kept and rejected: every request gets the tokens it
    gets without speculation (the rejected guesses' state rewound: model/rewind.py)."""
    from app.engine.speculation import SpeculativeConfig

    seeds = range(len(PROMPTS)) if seeded else None
    want, _ = generate(echo_dir, PROMPTS, max_tokens=24, seeds=seeds, prefill_chunk=64)
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}', None)
    got, h = generate(echo_dir, PROMPTS, max_tokens=24, seeds=seeds, prefill_chunk=64, speculative=spec)
    counters = h.planner.speculation.stats
    assert got == want
    assert counters.draft_tokens > counters.accepted_tokens > (0 if seeded else 5), counters
