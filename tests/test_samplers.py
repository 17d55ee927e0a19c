"""The samplers beyond the kernels' (typical-p, dynamic temperature, XTC, DRY, mirostat 2,
allowed_token_ids, bad_words, a penalty window, llama-server's sampler chain), held to references written here from their published
definitions (llama.cpp's where it defines them), on NumPy, numba and the CUDA backend (whose
rows for them go through the NumPy reference on the host)."""

from dataclasses import replace

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_chain import chain_draw
from model.ops.numpy_dry import apply_dry
from model.ops.numpy_ops import NumpyOps
from model.ops.numpy_sampling import apply_penalties, pick
from model.ops.protocol import SampleBatch
from model.sampling import XTC_STREAM, SamplingParams, seeded_uniform

N = 1000  # evenly spread uniforms: token t is drawn about N * p_t times


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def typical_reference(probs, mass):
    """Meister et al.: tokens by |-log p - H| ascending, until their mass passes `mass`."""
    nz = np.flatnonzero(probs > 0)
    entropy = -sum(probs[t] * np.log(probs[t]) for t in nz)
    by_distance = sorted(nz, key=lambda t: (abs(-np.log(probs[t]) - entropy), -probs[t], t))
    kept, total = [], 0.0
    for t in by_distance:
        kept.append(t)
        total += probs[t]
        if total > mass:
            break
    return kept


def distribution(kept, probs):
    out = np.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def counts(logits, p, coin=1.0):
    picks = [pick(np.asarray(logits, np.float32), p, (i + 0.5) / N, coin) for i in range(N)]
    return np.bincount(picks, minlength=len(logits))


LOGITS = (np.random.default_rng(7).standard_normal(60) * 2).astype(np.float32)


@pytest.mark.parametrize("mass,temperature", [(0.2, 1.0), (0.5, 1.0), (0.9, 0.7), (0.95, 1.5)])
def test_typical_p_keeps_the_tokens_nearest_the_entropy(mass, temperature):
    probs = softmax(LOGITS / temperature)
    want = distribution(typical_reference(probs, mass), probs)
    got = counts(LOGITS, SamplingParams(temperature=temperature, typical_p=mass))
    assert np.abs(got - N * want).max() <= 2, (mass, temperature)


def test_typical_p_after_top_k():
    probs = softmax(LOGITS)
    top = np.argsort(-probs, kind="stable")[:10]
    within = np.zeros_like(probs)
    within[top] = probs[top] / probs[top].sum()
    want = distribution(typical_reference(within, 0.6), within)
    assert np.abs(counts(LOGITS, SamplingParams(top_k=10, typical_p=0.6)) - N * want).max() <= 2


@pytest.mark.parametrize("temperature,span,exponent", [(1.0, 0.5, 1.0), (0.8, 0.8, 2.0), (1.2, 1.0, 0.5)])
def test_dynamic_temperature_follows_the_entropy(temperature, span, exponent):
    """llama.cpp's temp_ext: T = low + (high - low) * (H / log n) ** exponent, H at temperature 1."""
    for logits in (LOGITS, LOGITS * 4):  # an unsure row and a confident one
        probs = softmax(logits)
        entropy = -(probs * np.log(probs)).sum()
        low, high = max(0.0, temperature - span), temperature + span
        t = low + (high - low) * (entropy / np.log(len(probs))) ** exponent
        want = softmax(logits / t)
        got = counts(logits, SamplingParams(temperature=temperature, dynatemp_range=span, dynatemp_exponent=exponent))
        assert np.abs(got - N * want).max() <= 2


def xtc_reference(probs, threshold):
    """llama.cpp's xtc: of the tokens at or above the threshold, all but the least likely go,
    when there are at least two."""
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    above = [t for t in order if probs[t] >= threshold]
    return order[len(above) - 1:] if len(above) >= 2 else order


@pytest.mark.parametrize("threshold,top_k", [(0.1, 0), (0.05, 0), (0.2, 8), (0.3, 0)])
def test_xtc_excludes_the_top_choices_when_its_coin_says(threshold, top_k):
    logits = np.log([0.3, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02]).astype(np.float32) + 0
    logits = np.concatenate([logits, np.full(20, -8.0, np.float32)])
    probs = softmax(logits)
    p = SamplingParams(xtc_probability=0.5, xtc_threshold=threshold, top_k=top_k)
    within = distribution(np.argsort(-probs, kind="stable")[:top_k], probs) if top_k else probs
    want = distribution(xtc_reference(within, threshold), within)
    assert np.abs(counts(logits, p, coin=0.3) - N * want).max() <= 2  # the coin under the probability
    assert np.abs(counts(logits, p, coin=0.7) - N * within).max() <= 2  # over it: nothing excluded
    off = SamplingParams(xtc_probability=1.0, xtc_threshold=0.6, top_k=top_k)  # above 0.5: off, as llama.cpp
    assert np.abs(counts(logits, off, coin=0.0) - N * within).max() <= 2


def test_xtc_coin_is_keyed_apart_from_the_draw():
    coins = [seeded_uniform(9, i, XTC_STREAM) for i in range(2000)]
    draws = [seeded_uniform(9, i) for i in range(2000)]
    assert coins != draws and abs(np.corrcoef(coins, draws)[0, 1]) < 0.1
    assert 0.45 < np.mean(np.array(coins) < 0.5) < 0.55
    batch = SampleBatch([SamplingParams(xtc_probability=0.5, seed=9)], [()], [[1, 2, 3]], np.random.default_rng(0))
    assert batch.coin(0) == seeded_uniform(9, 3, XTC_STREAM) and batch.uniform(0) == seeded_uniform(9, 3)


def sample(ops, logits, params, prompts=None, outputs=None, seed=0, with_mu=False):
    rows = len(params)
    batch = SampleBatch(params, prompts or [()] * rows, outputs or [()] * rows, np.random.default_rng(seed))
    got = ops.sample(logits, batch)
    ids = [int(t) for t in ops.to_host(got.token_ids)]
    return (ids, got.mirostat_mu or [None] * rows) if with_mu else ids


def test_allowed_token_ids_and_bad_words():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((1, 50)).astype(np.float32)
    allowed = SamplingParams(allowed_token_ids=(3, 7, 11), seed=1)
    drawn = {sample(NumpyOps(), logits, [SamplingParams(**{**vars(allowed), "seed": s})])[0] for s in range(200)}
    assert drawn == {3, 7, 11}
    logits[0, 5] = 20.0  # the greedy choice, unless banned
    greedy = SamplingParams(temperature=0.0, bad_words=((5,), (9, 8, 4)))
    assert sample(NumpyOps(), logits, [greedy], outputs=[[1, 2]])[0] != 5
    logits[0, 4] = 30.0
    # a word's last token is banned only right after the rest of it
    assert sample(NumpyOps(), logits, [greedy], outputs=[[9, 8]])[0] not in (4, 5)
    assert sample(NumpyOps(), logits, [greedy], outputs=[[8, 9]])[0] == 4
    assert sample(NumpyOps(), logits, [greedy], outputs=[[8]])[0] == 4


def test_penalty_window_counts_only_the_last_n_tokens():
    """llama-server's penalty_last_n: the repetition penalty over the last n of prompt and output;
    -1 all of them, 0 none."""
    logits = np.zeros((1, 10), np.float32)
    logits[0, [1, 2]] = 5.0, 4.0
    prompt, output = [1, 3], [4, 6]
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(NumpyOps(), logits, [p], [prompt], [output])[0] == 2  # 1 is 2.5 after the penalty, 2 is 4
    assert sample(NumpyOps(), logits, [SamplingParams(**{**vars(p), "penalty_last_n": 3})], [prompt], [output])[0] == 1
    assert sample(NumpyOps(), logits, [SamplingParams(**{**vars(p), "penalty_last_n": 0})], [prompt], [output])[0] == 1
    output = [1, 6]
    assert sample(NumpyOps(), logits, [SamplingParams(**{**vars(p), "penalty_last_n": 2})], [prompt], [output])[0] == 2
    assert sample(NumpyOps(), logits, [SamplingParams(**{**vars(p), "penalty_last_n": 1})], [prompt], [output])[0] == 1


def dry_reference(context, vocab, multiplier, base, allowed, last_n, breakers):
    """p-e-w's definition, by brute force: a token that followed a stretch equal to the
    context's last L tokens (no breaker among them, nor the token) loses multiplier *
    base ** (L - allowed) for its longest such L >= allowed."""
    context = context[-last_n:] if last_n > 0 else context
    penalty = np.zeros(vocab)
    for i in range(1, len(context)):
        if context[i] in breakers:
            continue
        length = 0
        while (length < i and context[i - 1 - length] == context[len(context) - 1 - length]
               and context[i - 1 - length] not in breakers):
            length += 1
        if length >= max(allowed, 1):
            penalty[context[i]] = max(penalty[context[i]], multiplier * base ** (length - allowed))
    return penalty


@pytest.mark.parametrize("multiplier,base,allowed,last_n,breakers", [
    (0.8, 1.75, 2, -1, ()), (1.0, 2.0, 1, -1, (7,)), (0.5, 1.5, 3, 40, ()), (2.0, 1.1, 0, 25, (3, 9))])
def test_dry_penalises_what_would_continue_a_repeat(multiplier, base, allowed, last_n, breakers):
    rng = np.random.default_rng(int(base * 10))
    phrase = rng.integers(0, 12, 6).tolist()
    prompt = rng.integers(0, 12, 20).tolist() + phrase + rng.integers(0, 12, 5).tolist()
    output = phrase[:4] + rng.integers(0, 12, 3).tolist() + phrase[:5]
    logits = rng.standard_normal(12).astype(np.float32)
    p = SamplingParams(dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed,
                       dry_penalty_last_n=last_n, dry_sequence_breakers=breakers)
    want = logits - dry_reference(prompt + output, 12, multiplier, base, allowed, last_n, set(breakers))
    assert (want < logits).any()  # the case penalises something
    got = logits.copy()
    apply_dry(got, p, prompt, output)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    greedy = SamplingParams(**{**vars(p), "temperature": 0.0})
    assert sample(NumpyOps(), logits[None], [greedy], [prompt], [output])[0] == int(np.argmax(want))


def test_dry_is_off_as_llama_cpp_has_it():
    logits = np.zeros(5, np.float32)
    for p in (SamplingParams(dry_multiplier=0.0), SamplingParams(dry_multiplier=1.0, dry_base=0.9),
              SamplingParams(dry_multiplier=1.0, dry_penalty_last_n=0)):
        apply_dry(logits, p, [1, 2, 3, 1, 2, 3, 1, 2], [3, 1, 2])
        assert not logits.any() and not p.extended


def mirostat_reference(logits, temperature, tau, eta, mu, u):
    """llama.cpp's mirostat_v2, step by step: softmax, sorted; cut at the first token whose
    surprise -log2 p passes mu (keep one at least); renormalise; draw; mu -= eta * (surprise - tau)."""
    probs = softmax(np.asarray(logits, np.float64) / temperature)
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    kept = []
    for t in order:
        if -np.log2(probs[t]) > mu:
            break
        kept.append(t)
    kept = kept or order[:1]
    weights = probs[kept] / probs[kept].sum()
    at = min(int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right")), len(kept) - 1)
    return kept[at], mu - eta * (-np.log2(weights[at]) - tau)


@pytest.mark.parametrize("temperature,tau,eta", [(1.0, 5.0, 0.1), (0.8, 3.0, 0.3), (1.3, 2.0, 1.0)])
def test_mirostat_2_follows_llama_cpp_and_carries_mu(temperature, tau, eta):
    """A seeded request over 30 steps: each token and each mu as the reference's, with the mu
    handed back by the sampler passed in at the next step (as the engine keeps it)."""
    rng = np.random.default_rng(int(tau * 10))
    p = SamplingParams(temperature=temperature, mirostat=2, mirostat_tau=tau, mirostat_eta=eta, seed=21)
    mu, want_mu, output = None, 2 * tau, []
    sizes = set()
    for step in range(30):
        logits = (rng.standard_normal((1, 200)) * 3).astype(np.float32)
        step_p = SamplingParams(**{**vars(p), "mirostat_mu": mu})
        got = NumpyOps().sample(logits, SampleBatch([step_p], [()], [list(output)], rng))
        want, want_mu = mirostat_reference(logits[0], temperature, tau, eta, want_mu, seeded_uniform(21, step))
        assert int(got.token_ids[0]) == want and got.mirostat_mu[0] == pytest.approx(want_mu, abs=1e-5), step
        mu = got.mirostat_mu[0]
        output.append(want)
        sizes.add(int((softmax(logits[0] / temperature) >= 2.0 ** -mu).sum()))
    assert len(sizes) > 1  # mu moved the cut


LLAMA_CPP_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SPOOL_ORDER = ("penalties", "dry", "temperature", "top_n_sigma", "min_p", "top_k", "typ_p", "top_p", "xtc")


@pytest.mark.parametrize("seed", range(12))
def test_a_chain_in_spools_own_order_draws_what_spool_draws(seed):
    """samplers naming Spool's own order (temperature first) gives the tokens of the request
    without it, over a spread of uniforms: the chain's stages are the same samplers."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(300) * 2.5).astype(np.float32)
    p = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.choice([0, 5, 40])),
                       top_p=float(rng.choice([1.0, 0.9, 0.6])), min_p=float(rng.choice([0.0, 0.05])),
                       top_n_sigma=float(rng.choice([-1.0, 1.5])), typical_p=float(rng.choice([1.0, 0.8])),
                       xtc_probability=float(rng.choice([0.0, 1.0])), xtc_threshold=0.05,
                       repetition_penalty=float(rng.choice([1.0, 1.3])), dry_multiplier=float(rng.choice([0.0, 2.0])))
    if p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0 and p.top_n_sigma < 0 and p.typical_p == 1.0:
        p = replace(p, top_k=20)  # unfiltered, Spool draws in id order, a chain in probability order
    prompt, output = [2, 17, 5, 9, 40, 17, 5], [9, 40, 17]
    chained = replace(p, samplers=SPOOL_ORDER)
    coin = 0.5  # XTC's: below xtc_probability 1.0, so it acts
    for u in np.linspace(0.0005, 0.9995, 200):
        assert chain_draw(logits, chained, prompt, output, u, coin) == pick_row(logits, p, prompt, output, u, coin)


def pick_row(logits, p, prompt, output, u, coin):
    """NumpyOps' draw of one row in Spool's own order, with a given uniform and coin."""
    row = logits.copy()
    apply_penalties(row, p, prompt, output)
    apply_dry(row, p, prompt, output)
    return pick(row, p, u, coin)


def test_llama_cpps_chain_puts_the_temperature_last():
    """At temperature 2 with top_p 0.5: llama.cpp's default chain cuts the nucleus at
    temperature 1 (one token left), Spool's order after the temperature flattened it (two)."""
    logits = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    p = SamplingParams(temperature=2.0, top_p=0.5)
    draws = {order: {chain_draw(logits, replace(p, samplers=order), [], [], u, 1.0) for u in (0.1, 0.5, 0.9)}
             for order in (LLAMA_CPP_CHAIN, SPOOL_ORDER)}
    assert draws == {LLAMA_CPP_CHAIN: {0}, SPOOL_ORDER: {0, 1}}
    assert chain_draw(logits, replace(p, samplers=("top_k",)), [], [], 0.95, 1.0) == 2  # no temperature, no top_p


EXTENDED = [SamplingParams(typical_p=0.7, seed=1), SamplingParams(temperature=0.9, dynatemp_range=0.5, seed=2),
            SamplingParams(xtc_probability=0.8, xtc_threshold=0.05, seed=3),
            SamplingParams(allowed_token_ids=tuple(range(0, 300, 7)), top_p=0.9, seed=4),
            SamplingParams(bad_words=((2, 3), (17,)), temperature=0.0),
            SamplingParams(repetition_penalty=1.5, penalty_last_n=4, seed=5),
            SamplingParams(dry_multiplier=3.0, dry_allowed_length=1, seed=7),
            SamplingParams(mirostat=2, mirostat_tau=3.0, mirostat_mu=4.5, seed=8),
            SamplingParams(typical_p=0.9, xtc_probability=1.0, xtc_threshold=0.02, dynatemp_range=0.3, top_k=40,
                           seed=6),
            SamplingParams(samplers=LLAMA_CPP_CHAIN, top_k=40, top_p=0.9, min_p=0.05, temperature=0.8,
                           repetition_penalty=1.2, dry_multiplier=2.0, seed=9),
            SamplingParams(samplers=("top_p", "temperature", "top_k"), top_p=0.8, top_k=3, temperature=1.5, seed=13)]
PLAIN = [SamplingParams(seed=10), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, seed=11),
         SamplingParams(repetition_penalty=1.3, seed=12)]


@pytest.mark.parametrize("backend", ["numba", "cuda harness"])
def test_backends_draw_what_the_reference_draws_alone_and_in_a_batch(backend):
    """Each extended row on numba (its fallback) and on CUDA (the host reference) gets the NumPy
    reference's token, over several steps, alone and beside plain rows in any order."""
    ops = NumbaOps() if backend == "numba" else CudaOps(np, CpuLauncher())
    rng = np.random.default_rng(11)
    params = EXTENDED + PLAIN
    order = rng.permutation(len(params))
    for step in range(4):
        logits = (rng.standard_normal((len(params), 300)) * 2.5).astype(np.float32)
        prompts = [[2, 17, 5, 9, 40]] * len(params)
        outputs = [[2, *range(50, 50 + step)] for _ in params]
        want, want_mu = sample(NumpyOps(), logits[:len(EXTENDED)], EXTENDED, prompts[:len(EXTENDED)],
                               outputs[:len(EXTENDED)], with_mu=True)
        assert [mu is not None for mu in want_mu] == [p.mirostat == 2 for p in EXTENDED]
        for r, p in enumerate(EXTENDED):
            alone = sample(ops, logits[r:r + 1], [p], prompts[:1], outputs[:1], seed=step, with_mu=True)
            assert (alone[0][0], alone[1][0]) == (want[r], want_mu[r]), (backend, step, p)
        mixed, mixed_mu = sample(ops, logits[order], [params[i] for i in order], prompts, outputs, seed=99,
                                 with_mu=True)
        got = {int(i): (t, mu) for i, t, mu in zip(order, mixed, mixed_mu)}
        assert [got[r] for r in range(len(EXTENDED))] == list(zip(want, want_mu)), (backend, step)


@pytest.mark.parametrize("p", EXTENDED, ids=range(len(EXTENDED)))
def test_seeded_rows_are_reproducible(p):
    logits = (np.random.default_rng(4).standard_normal((1, 300)) * 2).astype(np.float32)
    runs = {tuple(sample(NumpyOps(), logits, [p], outputs=[[1, 2, 3]], seed=s)) for s in range(5)}
    assert len(runs) == 1  # the batch's rng is not read by a seeded row


@pytest.mark.parametrize("field,value", [("typical_p", 0.0), ("typical_p", 1.01), ("dynatemp_range", -1.0),
                                         ("dynatemp_exponent", -0.5), ("xtc_probability", 1.5),
                                         ("xtc_threshold", -0.1), ("xtc_threshold", float("nan")),
                                         ("penalty_last_n", -2), ("allowed_token_ids", (5, 1000)),
                                         ("allowed_token_ids", ()), ("bad_words", ((1, 2000),)),
                                         ("dry_multiplier", -0.5), ("dry_allowed_length", -1),
                                         ("dry_penalty_last_n", -3), ("dry_base", float("inf")),
                                         ("mirostat", 1), ("mirostat_tau", -1.0), ("mirostat_eta", float("nan")),
                                         ("samplers", ("top_k", "infill"))])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value}).validate(1000)
