"""cuda/sampling.cu's radix select on rows with huge vocabularies and huge groups of tied logits,
where a warp's lanes mostly fall in one histogram bin (the histograms are aggregated per warp
before the block's atomics). The reference is the kernel's own contract written in NumPy: top-k
keeps every token whose weight reaches the k-th largest weight (ties all kept), top-p the
fewest weights from the top, tie groups whole, that reach p of the mass, min-p a floor on the
weight; then one inverse-CDF draw over the kept tokens in id order."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher

SAMPLE_THREADS = 1024  # model/ops/cuda_sampler.py's block


@pytest.fixture(scope="module")
def launcher():
    return CpuLauncher()


def run_sample(launcher, logits, top_k, top_p, min_p, uniform, temperature=1.0):
    rows, vocab = logits.shape
    per_row = lambda v, t: np.full(rows, v, dtype=t)  # noqa: E731
    out = np.full(rows, -7, dtype=np.int32)
    launcher.function("sampling.cu", "sample")((rows,), (SAMPLE_THREADS,), (
        out, np.ascontiguousarray(logits, dtype=np.float32), per_row(temperature, np.float32),
        per_row(top_k, np.int32), per_row(top_p, np.float32), per_row(min_p, np.float32),
        per_row(-1.0, np.float32), np.asarray(uniform, dtype=np.float32), np.int32(vocab)))
    return out


def kept(weights: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kernel's kept set, as a mask: thresholds on the weights (ties on one side together)."""
    floor = np.float32(min_p)
    if 0 < top_k < weights.size:
        floor = max(floor, np.sort(weights[weights >= floor])[::-1][min(top_k, int((weights >= floor).sum())) - 1])
    if top_p < 1.0:
        values, counts = np.unique(weights[weights >= floor], return_counts=True)
        mass = np.cumsum((values * counts.astype(np.float64))[::-1])  # from the largest weight down
        floor = max(floor, values[::-1][int(np.searchsorted(mass, top_p * mass[-1]))])
    return weights >= floor


def tied_row(rng, vocab: int, levels: int) -> np.ndarray:
    """A few distinct leaders, then every other token on one of a few levels: groups of tens of
    thousands of equal logits, shuffled over the row."""
    row = (-0.5 * rng.integers(0, levels, vocab)).astype(np.float32)
    leaders = rng.choice(vocab, 12, replace=False)
    row[leaders] = 1.5 + 0.25 * np.arange(12, dtype=np.float32)
    return row


@pytest.mark.parametrize("vocab,filters", [(152064, (40, 1.0, 0.0)), (152064, (0, 0.6, 0.0)),
                                           (262208, (5000, 0.9, 0.01))])
def test_huge_vocabularies_of_ties_draw_what_the_reference_draws(launcher, vocab, filters):
    top_k, top_p, min_p = filters
    rng = np.random.default_rng(vocab + top_k)
    row = tied_row(rng, vocab, levels=6)
    n = 3
    uniform = (np.arange(n) + 0.5) / n
    got = run_sample(launcher, np.repeat(row[None], n, axis=0), top_k, top_p, min_p, uniform)
    weights = np.exp(row - row.max())
    mask = kept(weights, top_k, top_p, min_p)
    assert mask[got].all(), (got, filters)
    kept_weights = np.where(mask, weights, 0.0).astype(np.float64)
    after = np.cumsum(kept_weights) / kept_weights.sum()
    for u, token in zip(uniform, got):
        want = int(np.searchsorted(after, u, side="right"))
        near = abs(after[want] - u) < 1e-5 or (want and abs(after[want - 1] - u) < 1e-5)
        assert token == want or near, (u, token, want)


@pytest.mark.parametrize("vocab", [262208])
def test_a_row_of_one_logit_repeated_keeps_every_token(launcher, vocab):
    """Every token tied: top-k and top-p keep the whole row, and the draw walks it in id order."""
    logits = np.zeros((3, vocab), dtype=np.float32)
    uniform = np.array([0.0, 0.5, 0.999999], dtype=np.float32)
    got = run_sample(launcher, logits, 10, 0.5, 0.0, uniform)
    want = np.minimum((uniform.astype(np.float64) * vocab).astype(np.int64), vocab - 1)
    assert np.abs(got - want).max() <= 1, (got, want)
