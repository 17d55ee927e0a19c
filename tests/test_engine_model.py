"""The engine's planner and output processor driving the tiny real model: greedy outputs do not
depend on how the work was scheduled (prefix cache, preemption by spill or recompute, prefill
chunk size)."""

import pytest

from engine_harness import Harness
from model.runner import ModelRunner
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris. The capital of Italy is Rome. Hello",
    "The capital of France is Paris. The capital of Italy is Rome. How are",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Hello world! How are you today? I am fine, thank you.",
    "Café, naïve, Straße, 東京, 😀 and text.",
]


@pytest.fixture(scope="module")
def setup(tiny_dir):
    tok = Tokenizer(tiny_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    return tiny_dir, tok, prompts


def generate(setup, num_blocks=128, prefix_caching=True, **config):
    path, tok, prompts = setup
    runner = ModelRunner.from_dir(path, num_blocks=num_blocks, block_size=4)
    h = Harness(runner, tok, prefix_caching=prefix_caching, **config)
    rids = [h.submit(p, max_tokens=16, ignore_eos=True) for p in prompts]
    h.run()
    assert h.pool.used == 0
    return [h.tokens(r) for r in rids], [h.text(r) for r in rids], h


@pytest.fixture(scope="module")
def baseline(setup):
    tokens, texts, _ = generate(setup, prefix_caching=False, prefill_chunk=64)
    assert all(len(t) == 16 for t in tokens)
    return tokens, texts


def test_prefix_cache_changes_nothing(setup, baseline):
    tokens, texts, h = generate(setup, prefix_caching=True, max_seqs=1, prefill_chunk=64)
    assert h.stats.prefix_cache_hits > 0  # the two "capital" prompts share full blocks
    assert tokens == baseline[0] and texts == baseline[1]


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "spill"])
def test_preemption_changes_nothing(setup, baseline, swap_blocks):
    tokens, texts, h = generate(setup, num_blocks=24, swap_blocks=swap_blocks, prefill_chunk=64, immunity_tokens=2)
    assert h.stats.preemptions > 0
    assert tokens == baseline[0] and texts == baseline[1]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunk_size_changes_nothing(setup, baseline, chunk):
    tokens, texts, _ = generate(setup, prefill_chunk=chunk)
    assert tokens == baseline[0] and texts == baseline[1]


def test_a_constrained_request_changes_nothing_for_its_batch_mates(setup):
    """Greedy outputs of unconstrained requests are the same with a grammar-constrained request
    in their batch as without it, and the constrained one follows its grammar."""
    import re

    import llguidance

    path, tok, prompts = setup

    def run(constrained: bool):
        h = Harness(ModelRunner.from_dir(path, num_blocks=128, block_size=4), tok)
        rids = [h.submit(p, max_tokens=12, ignore_eos=True) for p in prompts[:3]]
        extra = h.submit(prompts[3], max_tokens=12, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z]+( [a-z]+)*"),
                         sampling=SamplingParams(temperature=0.0)) if constrained else None
        h.run()
        return [h.tokens(r) for r in rids], extra and h.text(extra)

    alone, _ = run(False)
    together, text = run(True)
    assert together == alone
    assert re.fullmatch("[a-z]+( [a-z]+)*", text), text


def test_masks_are_computed_while_the_forward_pass_runs(setup):
    """Every constrained step's masks wait until the runner has started its forward pass: were
    they computed before it (or after it, in the same thread), the step would never finish."""
    import threading

    import llguidance

    path, tok, prompts = setup
    forward_started = threading.Event()

    class Runner(ModelRunner):
        def forward(self, plan):
            forward_started.set()
            return super().forward(plan)

    h = Harness(Runner.from_dir(path, num_blocks=128, block_size=4), tok)
    mask_now = h.outputs.mask_now

    def mask_after_forward_started(request):
        assert forward_started.wait(timeout=30), "the mask was wanted before the forward pass began"
        return mask_now(request)

    h.outputs.mask_now = mask_after_forward_started
    rid = h.submit(prompts[0], max_tokens=6, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z]+"))
    while h.planner.has_work:
        forward_started.clear()
        h.tick()
    assert len(h.tokens(rid)) >= 1 and h.text(rid).isalpha()
