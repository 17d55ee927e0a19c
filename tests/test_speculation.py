"""Speculative decoding with n-gram prompt lookup (app/engine/speculation.py), on the tiny
model's q8_0 CPU path, whose logits are the same bits however a row's tokens are chunked: greedy
and seeded rows write exactly the tokens of plain decoding, through aborts and preemption; an
unseeded row's tokens keep the model's distribution (a chi-square test); the KV blocks of
rejected guesses go back to the pool and never into the prefix cache."""

import math
from pathlib import Path

import numpy as np
import pytest

from app.engine.speculation import NgramProposer, SpeculativeConfig
from engine_harness import Harness
from model.draft import DraftModel
from model.ops.numba_ops import NumbaOps
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-spec"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another tiny model, one layer, other weights, the same tokenizer: a draft that is often wrong."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, layers=1)


@pytest.fixture(params=["ngram", "draft_model"])
def method(request, draft_dir):
    """make(k): a SpeculativeConfig of that method."""
    def make(k, lookup_min=1, lookup_max=3):
        if request.param == "ngram":
            return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lookup_min,
                                     prompt_lookup_max=lookup_max)
        return SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=k)

    make.name = request.param
    return make


def runner(model_dir, num_blocks=1024):
    return ModelRunner.from_dir(model_dir, num_blocks=num_blocks, block_size=BLOCK, ops=NumbaOps("q8_0"), seed=0)


def copy_heavy_prompts(rng, count):
    """Prompts that repeat themselves, so lookup has something to propose."""
    prompts = []
    for _ in range(count):
        motif = rng.integers(5, 250, size=int(rng.integers(2, 8))).tolist()
        prompts.append(motif * int(rng.integers(2, 6)) + rng.integers(5, 250, size=int(rng.integers(0, 5))).tolist())
    return prompts


def test_lookup_proposes_what_followed_the_longest_earlier_suffix():
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert proposer.propose([5, 1, 2, 7, 7, 2, 1, 2], 2) == [7, 7]  # [1, 2] beats [2], the latest [2]
    assert proposer.propose([4, 4, 4, 4], 3) == [4]  # only overlapping occurrences: the latest's one token
    assert proposer.propose([4, 4, 4, 4, 4, 4, 4], 2) == [4, 4]
    assert proposer.propose([1, 2, 3], 4) == []
    assert NgramProposer(lookup_min=2, lookup_max=2).propose([1, 2, 9, 3, 2], 2) == []


@pytest.mark.parametrize("text,error", [
    ("{", "is not JSON"), ("[1]", "must be a JSON object"), ('{"method": "eagle"}', "Spool has 'ngram'"),
    ('{"num_speculative_tokens": 0}', "positive integer"), ('{"k": 1}', "unknown keys"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min is over"),
])
def test_a_bad_speculative_config_is_one_line(text, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.parse(text)


def run(model_dir, tokenizer, prompts, sampling, spec, num_blocks=1024, aborts=None, max_seqs=8, **params):
    """Each prompt's tokens; aborts: {prompt index: tick at which it is aborted}. A spec whose
    method is draft_model names the draft's directory as its model."""
    target = runner(model_dir, num_blocks)
    if spec is not None and spec.method == "draft_model":
        target.draft = DraftModel(runner(Path(spec.model), num_blocks))
    h = Harness(target, tokenizer, speculative=spec, max_seqs=max_seqs,
                max_batched_tokens=64, prefill_chunk=32, max_queue=len(prompts))
    ids = [h.submit(p, sampling=sampling[i] if isinstance(sampling, list) else sampling, **params)
           for i, p in enumerate(prompts)]
    for tick in range(10_000):
        if not h.planner.has_work:
            break
        for index, at in (aborts or {}).items():
            if at == tick:
                h.engine.abort(ids[index])
        h.tick()
        for request in h.planner.queues.decoding:  # no block held past the next row's position
            held = request.schedule.dropped_blocks + len(request.schedule.block_table)
            assert held <= h.pool.blocks_for(request.num_tokens)
    return [h.tokens(i) for i in ids], [h.final(i).finish_reason for i in ids], h


def test_greedy_tokens_are_those_of_plain_decoding_through_aborts_and_preemption(model_dir, tokenizer, method):
    """200 random prompts in batches, random k, random aborts, and a KV pool small enough that
    requests are preempted and recomputed: every request that was not aborted writes exactly
    the tokens of plain decoding, and an aborted one a prefix of them."""
    rng = np.random.default_rng(1)
    prompts = copy_heavy_prompts(rng, 200)
    greedy = SamplingParams(temperature=0.0)
    kept = preempted = 0
    for batch in range(0, 200, 25):
        chunk = prompts[batch:batch + 25]
        plain, _, _ = run(model_dir, tokenizer, chunk, greedy, None, max_tokens=24, ignore_eos=True)
        k = int(rng.integers(1, 7))
        aborts = {int(i): int(rng.integers(1, 40)) for i in rng.choice(len(chunk), size=4, replace=False)}
        spec = method(k)
        tokens, reasons, h = run(model_dir, tokenizer, chunk, greedy, spec, num_blocks=48, aborts=aborts,
                                 max_tokens=24, ignore_eos=True)
        for i, (mine, theirs, reason) in enumerate(zip(tokens, plain, reasons)):
            if i in aborts and reason == "cancelled":
                assert mine == theirs[:len(mine)], (batch + i, k)
            else:
                assert mine == theirs and reason == "length", (batch + i, k)
        kept += h.planner.speculation.stats.accepted_tokens
        preempted += h.stats.preemptions
        assert h.pool.used == 0  # every block, guesses' included, went back
    assert kept > (500 if method.name == "ngram" else 100) and preempted > 0  # guesses kept; requests preempted


def test_seeded_sampling_writes_the_same_text_with_speculation_on_and_off(model_dir, tokenizer, method):
    rng = np.random.default_rng(2)
    prompts = copy_heavy_prompts(rng, 24)
    sampling = [SamplingParams(temperature=float(rng.uniform(0.3, 1.5)), top_p=float(rng.uniform(0.7, 1.0)),
                               seed=int(rng.integers(1 << 30)), logprobs=2) for _ in prompts]
    plain, _, _ = run(model_dir, tokenizer, prompts, sampling, None, max_tokens=32, ignore_eos=True)
    tokens, _, h = run(model_dir, tokenizer, prompts, sampling, method(4), max_tokens=32, ignore_eos=True)
    assert tokens == plain
    assert h.planner.speculation.stats.accepted_tokens > 20


def test_stops_and_max_tokens_land_on_the_token_plain_decoding_lands_on(model_dir, tokenizer, method):
    """A stop token among kept guesses ends the request there; nothing after it goes out."""
    rng = np.random.default_rng(3)
    prompts = copy_heavy_prompts(rng, 16)
    greedy = SamplingParams(temperature=0.0)
    plain, _, _ = run(model_dir, tokenizer, prompts, greedy, None, max_tokens=20, ignore_eos=True)
    stops = [p[len(p) // 2] for p in plain]  # a token each request writes mid-way
    spec = method(5)
    for stop_set in ([], stops):
        expected, want, _ = run(model_dir, tokenizer, prompts, greedy, None, max_tokens=20, ignore_eos=True,
                                stop_token_ids=stop_set)
        tokens, reasons, _ = run(model_dir, tokenizer, prompts, greedy, spec, max_tokens=20, ignore_eos=True,
                                 stop_token_ids=stop_set)
        assert tokens == expected and reasons == want


def test_unseeded_tokens_keep_the_models_distribution(model_dir, tokenizer, method):
    """6,000 requests of one prompt that lookup mostly has guesses for, four tokens each: the
    second to fourth tokens' counts, per prefix of the tokens before them, against the model's
    own probabilities there (a chi-square test: a verifier that kept one wrong guess in five
    fails it)."""
    prompt = [17, 42, 17, 42, 17, 42, 17, 42]
    sampling = SamplingParams(temperature=1.0)
    spec = method(2, lookup_max=2)
    tokens, _, h = run(model_dir, tokenizer, [prompt] * 6000, sampling, spec, max_seqs=64, max_tokens=4,
                       ignore_eos=True)
    assert h.planner.speculation.stats.accepted_tokens > (1000 if method.name == "ngram" else 200)
    nexts: dict[tuple, list[int]] = {}
    for t in tokens:
        for length in (1, 2, 3):
            nexts.setdefault(tuple(t[:length]), []).append(t[length])
    probe = runner(model_dir, 64)
    chi2, dof = 0.0, 0
    for prefix, seen in nexts.items():
        if len(seen) < 40:
            continue
        ids = prompt + list(prefix)
        logits = probe.logits(StepPlan([Row("p", ids, 0, list(range(-(-len(ids) // BLOCK))), sample=True)]))
        z = np.asarray(logits[0], np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        observed = np.bincount(seen, minlength=len(p)).astype(np.float64)
        expected = p * len(seen)
        big = expected >= 5
        cells_o = np.append(observed[big], observed[~big].sum())
        cells_e = np.append(expected[big], expected[~big].sum())
        chi2 += float(((cells_o - cells_e) ** 2 / cells_e).sum())
        dof += len(cells_o) - 1
    assert dof >= 10
    assert chi2_sf(chi2, dof) > 1e-3, (chi2, dof)


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for a chi-square of dof degrees, by Wilson and Hilferty's cube-root normal
    approximation (within a few percent of the exact tail at dof >= 10), so the test needs no SciPy."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_the_status_line_reports_acceptance(model_dir, tokenizer):
    from app.engine.status import StatusReporter

    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    _, _, h = run(model_dir, tokenizer, copy_heavy_prompts(np.random.default_rng(4), 4), SamplingParams(temperature=0),
                  spec, max_tokens=16, ignore_eos=True)
    s = h.planner.speculation.stats
    line = StatusReporter(1, h.pool, h.stats, h.planner.speculation).decode_line(h.planner.view(), h.planner.held_tokens())
    assert f"accept rate: {s.accepted_tokens / s.draft_tokens:.2f}" in line
    assert f"accept len: {1 + s.accepted_tokens / s.drafts:.2f}" in line


def test_a_server_with_speculation_writes_the_same_text_and_counts_it(model_dir):
    """`spool serve --speculative-config ...` against one without: the same greedy text over
    the official client, and vLLM's spec_decode counters in /metrics."""
    from live_server import LiveServer

    prompt = "one two three four one two three four one two three four one two"
    texts, counters = [], {}
    for flags in ((), ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3,'
                                               ' "prompt_lookup_min": 1}')):
        server = LiveServer(str(model_dir), "--dtype", "q8_0", "--kv-cache-gib", "0.05", *flags)
        try:
            with server.openai_client() as client:
                texts.append(client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=40,
                                                       temperature=0).choices[0].text)
            counters = {k: v for k, v in server.metrics().items() if "spec_decode" in k}
        finally:
            assert server.stop() == 0, server.output()
    assert texts[0] == texts[1] and len(texts[0]) > 0
    drafts = next(v for k, v in counters.items() if k.startswith("spool:spec_decode_num_drafts_total"))
    accepted = next(v for k, v in counters.items() if k.startswith("spool:spec_decode_num_accepted_tokens_total"))
    per_pos = sum(v for k, v in counters.items() if k.startswith("spool:spec_decode_num_accepted_tokens_per_pos"))
    assert drafts > 0 and accepted == per_pos


def test_the_model_as_its_own_draft_has_every_guess_kept(model_dir, tokenizer):
    """The draft's cache mirrors the target's through prefix-cache hits and rejected guesses:
    with the target as its own draft, greedy keeps every guess. Through preemption nearly
    every one: a victim's blocks can go to the prefix cache holding the target's K/V of a last
    kept guess the draft has not read yet, which a resumed request trusts (a guess, never a
    token, is then wrong)."""
    rng = np.random.default_rng(5)
    prompts = copy_heavy_prompts(rng, 24)
    prompts += [p[:len(p) // 2] + [7, 8, 9] for p in prompts[:8]]  # shared prefixes: prefix-cache hits
    spec = SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=4)
    greedy = SamplingParams(temperature=0.0)
    plain, _, _ = run(model_dir, tokenizer, prompts, greedy, None, max_tokens=24, ignore_eos=True)
    for num_blocks, seen in ((64, "preemptions"), (1024, "prefix_cache_hits")):
        tokens, _, h = run(model_dir, tokenizer, prompts, greedy, spec, num_blocks=num_blocks, max_tokens=24,
                           ignore_eos=True)
        s = h.planner.speculation.stats
        assert tokens == plain and getattr(h.stats, seen) > 0 and s.draft_tokens > 300
        assert s.accepted_tokens == s.draft_tokens if seen == "prefix_cache_hits" else \
            s.accepted_tokens >= 0.95 * s.draft_tokens


def test_a_draft_with_another_tokenizer_is_refused(model_dir, tmp_path):
    from model.backend import resolve
    from model.errors import ModelError

    other = make_tiny_model(tmp_path / "other", tokens=("<extra>",))
    with pytest.raises(ModelError, match="another tokenizer"):
        DraftModel.load(resolve("cpu", "q8_0"), other, runner(model_dir, 16), Tokenizer(model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_cuda_kernels_write_the_same_tokens(model_dir, tokenizer, monkeypatch, backend):
    """The CUDA backend (on a GPU, or its kernels on the CPU through the harness) decodes without
    its overlapped loop while rows carry guesses: lookup with greedy rows and the model as its
    own draft with seeded rows write the tokens of plain decoding on it."""
    import test_speculation
    from test_cuda_forward import cuda_ops

    monkeypatch.setattr(test_speculation, "runner", lambda path, num_blocks=1024: ModelRunner.from_dir(
        path, num_blocks=num_blocks, block_size=BLOCK, ops=cuda_ops(backend), seed=0))
    prompts = copy_heavy_prompts(np.random.default_rng(6), 4)
    seeded = [SamplingParams(temperature=0.9, seed=i) for i in range(4)]
    for sampling, spec in (
            (SamplingParams(temperature=0.0), SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)),
            (seeded, SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=3))):
        plain, _, h = test_speculation.run(model_dir, tokenizer, prompts, sampling, None, max_tokens=12,
                                           ignore_eos=True)
        assert h.engine.overlaps  # without guesses, the device's overlapped loop
        tokens, _, h = test_speculation.run(model_dir, tokenizer, prompts, sampling, spec, max_tokens=12,
                                            ignore_eos=True)
        assert tokens == plain and not h.engine.overlaps
        assert h.planner.speculation.stats.accepted_tokens > 5  # 10 of 32 by lookup (greedy), measured


def test_a_grammar_masks_every_verified_position(model_dir, tokenizer):
    """Rows under a grammar guess by lookup, each position sampled under the grammar's mask
    after the guesses before it: the same tokens as plain constrained decoding, every one the
    grammar's, and guesses kept (the grammar repeats itself, so lookup finds it)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_regex("(the cat|a dog)( (sat|ran) (the cat|a dog)){6}")
    prompts = copy_heavy_prompts(np.random.default_rng(7), 12)
    sampling = [SamplingParams(temperature=0.0)] * 6 + [SamplingParams(temperature=1.0, seed=i) for i in range(6)]
    plain, reasons, _ = run(model_dir, tokenizer, prompts, sampling, None, max_tokens=160, grammar=grammar)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens, spec_reasons, h = run(model_dir, tokenizer, prompts, sampling, spec, max_tokens=160, grammar=grammar)
    assert tokens == plain and spec_reasons == reasons == ["stop"] * 12
    import re

    assert all(re.fullmatch("(the cat|a dog)( (sat|ran) (the cat|a dog)){6}", tokenizer.decode(t)) for t in tokens)
    assert h.planner.speculation.stats.accepted_tokens > 50
