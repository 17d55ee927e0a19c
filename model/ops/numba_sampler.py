"""The numba sampler: every row that asks only for a temperature (or greedy) drawn in one
kernel over the batch; rows with filters, penalties, a grammar, logprobs or any sampler beyond
those (SamplingParams.extended) go to NumPy's.

The kernel reads C-ordered logits (a strided row costs an argmax 20 times more).
"""

import numpy as np
from numba import prange

from model.ops.numba_kernels import F1, F2, I1, kernel
from model.ops.protocol import SampleBatch, SampleResult


@kernel(f"void({F2}, {F1}, float64[::1], {I1}, {I1})")
def _draw(logits, temperature, u, rows, out):
    """Greedy (temperature 0) or a plain temperature draw by inverse CDF in token-id order,
    as NumpyOps.sample's unfiltered case: the first token whose running sum passes u * total."""
    vocab = logits.shape[1]
    for i in prange(rows.shape[0]):
        r = rows[i]
        best, top = 0, logits[r, 0]
        for v in range(1, vocab):
            if logits[r, v] > top:
                best, top = v, logits[r, v]
        if temperature[i] == 0.0:
            out[i] = best
            continue
        inv = np.float32(1.0) / temperature[i]
        total = 0.0
        for v in range(vocab):
            total += np.exp((logits[r, v] - top) * inv)
        target, running, pick = u[i] * total, 0.0, vocab - 1
        for v in range(vocab):
            running += np.exp((logits[r, v] - top) * inv)
            if running > target:
                pick = v
                break
        out[i] = pick


def plain(p) -> bool:
    """Asks for nothing but a temperature: no filters, bias, penalties, other samplers or logprobs."""
    return (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and p.top_n_sigma <= 0 and not p.logit_bias
            and not p.penalized and not p.extended and p.logprobs is None)


def sample(logits: np.ndarray, batch: SampleBatch, fallback) -> SampleResult:
    """fallback's contract (NumpyOps.sample, which draws every row this kernel does not); the
    plain rows drawn in one kernel, after the others."""
    logits = np.ascontiguousarray(logits)
    easy = [r for r, p in enumerate(batch.params) if plain(p) and batch.mask(r) is None]
    if not easy:
        return fallback(logits, batch)
    token_ids = np.empty(len(batch), dtype=np.int64)
    logprobs: list = [None] * len(batch)
    top: list = [None] * len(batch)
    mus: list = [None] * len(batch)
    rest = sorted(set(range(len(batch))) - set(easy))
    if rest:
        got = fallback(logits[rest], batch.take(rest))
        for i, r in enumerate(rest):
            token_ids[r], logprobs[r], top[r] = got.token_ids[i], got.logprobs[i], got.top_logprobs[i]
            mus[r] = got.mirostat_mu[i] if got.mirostat_mu else None
    u = np.array([batch.uniform(r) for r in easy])
    out = np.empty(len(easy), dtype=np.int64)
    rows = np.array(easy, dtype=np.int64)
    _draw(len(easy) * logits.shape[1], logits, np.array([batch.params[r].temperature for r in easy], dtype=np.float32),
          u, rows, out)
    token_ids[rows] = out
    return SampleResult(token_ids, logprobs, top, mus)
