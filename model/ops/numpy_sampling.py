"""The NumPy reference sampler's arithmetic, row by row: penalties and logit bias on the
logits, the kept set (top-k, top-p, min-p, top-nσ) and the inverse-CDF draw, and logprobs.
NumpyOps.sample runs it; the CPU's numba sampler and the CUDA kernels are held to it.
"""

import numpy as np

from model.ops.numpy_samplers import apply_penalties, dynamic_temperature, exclude_top_choices, locally_typical, \
    mirostat_v2, restrict
from model.ops.numpy_chain import chain_draw
from model.ops.numpy_dry import apply_dry
from model.ops.protocol import SampleBatch, SampleResult
from model.sampling import SamplingParams, allowed_tokens

NO_TOKEN = -1  # runner.NO_TOKEN: outside the vocabulary, so the row's request fails alone
# Candidates kept for top-k / top-p before falling back to a full sort of the vocabulary.
SAMPLING_CANDIDATES = 256


def sample_rows(logits: np.ndarray, batch: SampleBatch) -> SampleResult:
    """NumpyOps.sample: one token per row of host logits (rows, vocab), each row on its own;
    a mirostat row's new mu comes back beside its token."""
    token_ids = np.empty(len(batch), dtype=np.int64)
    logprobs: list = [None] * len(batch)
    top: list = [None] * len(batch)
    mus: list = [None] * len(batch)  # a greedy mirostat row keeps its mu
    for r, p in enumerate(batch.params):
        row = logits[r]
        mask = batch.mask(r)
        if mask is not None:  # a new array, so the raw logits stay for logprobs
            row = np.where(allowed_tokens(mask, row.shape[0]), row, np.float32(-np.inf))
        if p.logit_bias or p.penalized or p.extended:
            row = row if mask is not None else row.copy()
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
                row[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
            if p.samplers is None:  # else stages of the chain, where it names them
                apply_penalties(row, p, batch.prompts[r], batch.outputs[r])
                apply_dry(row, p, batch.prompts[r], batch.outputs[r])
            restrict(row, p, batch.outputs[r])
        if not np.isfinite(row).any():  # the row's constraints (or its logits) leave nothing
            token_ids[r] = NO_TOKEN
        elif p.samplers is not None and p.mirostat != 2:
            token_ids[r] = chain_draw(row, p, batch.prompts[r], batch.outputs[r], batch.uniform(r), batch.coin(r))
        elif p.greedy:
            token_ids[r] = int(np.argmax(row))
        elif p.mirostat == 2:
            token_ids[r], mus[r] = mirostat_v2(row, p, batch.uniform(r))
        else:
            token_ids[r] = pick(row, p, batch.uniform(r), batch.coin(r))
        if p.logprobs is not None:
            lsm = log_softmax(logits[r])
            logprobs[r] = float(lsm[token_ids[r]])
            top[r] = most_likely(lsm, p.logprobs)
    return SampleResult(token_ids, logprobs, top, mus)


def sigma_floor(logits: np.ndarray, p: SamplingParams, temperature: float) -> float:
    """Top-nσ's floor on a token's probability relative to the most likely: exp(-nσ / T), σ the
    standard deviation of the row's finite logits (0 when off)."""
    if p.top_n_sigma <= 0:
        return 0.0
    finite = logits[np.isfinite(logits)].astype(np.float64)
    below = finite - finite.max()
    sigma = np.sqrt(max(np.mean(below * below) - np.mean(below) ** 2, 0.0))
    return float(np.exp(-p.top_n_sigma * sigma / temperature))


def pick(logits: np.ndarray, p: SamplingParams, u: float, coin: float = 1.0) -> int:
    """Draw one token by inverse CDF over the kept candidates, taken in a canonical order
    (probability descending, then token id), so the draw depends only on logits and u.

    The temperature, dynamic if asked; filters: top-k, locally typical, then top-p over the
    renormalized rest, and a floor relative to the most likely token: min-p's, and top-nσ's (a
    logit n standard deviations below the largest, its weight at the temperature); XTC last,
    its coin the row's own uniform. Only the candidates are sorted, never the whole vocabulary
    unless top-p or typical needs more than SAMPLING_CANDIDATES tokens."""
    temperature = dynamic_temperature(logits, p)
    if temperature <= 0:  # a dynamic range reaching 0 on a certain row
        return int(np.argmax(logits))
    scaled = logits / np.float32(temperature)
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    vocab = probs.shape[0]
    top_k = p.top_k if 0 < p.top_k < vocab else 0
    floor = max(p.min_p, sigma_floor(logits, p, temperature))
    typical = p.typical_p < 1.0
    if not top_k and p.top_p >= 1.0 and floor <= 0.0 and not typical and not p.excludes_top_choices:
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), vocab - 1))
    if floor > 0.0:
        cand = np.flatnonzero(probs >= floor * probs.max())
    elif top_k:
        cand = np.argpartition(-probs, top_k - 1)[:top_k]
    elif typical or p.top_p >= 1.0:  # the whole distribution's entropy, or XTC alone
        cand = np.flatnonzero(probs > 0)
    else:  # top-p alone: the nucleus is usually small
        n = min(SAMPLING_CANDIDATES, vocab)
        cand = np.argpartition(-probs, n - 1)[:n]
        if probs[cand].sum() < p.top_p:
            cand = np.arange(vocab)
    cand = cand[np.lexsort((cand, -probs[cand]))]
    if top_k:
        cand = cand[:top_k]
    kept = probs[cand]
    if top_k or floor > 0.0:  # renormalised over what the filters left (not over top-p's shortlist)
        kept = kept / kept.sum()
    if typical:
        cand, kept = locally_typical(cand, kept, p.typical_p)
    if p.top_p < 1.0:
        nucleus = np.cumsum(kept) - kept < p.top_p
        cand, kept = cand[nucleus], kept[nucleus]
    if p.excludes_top_choices:
        cand, kept = exclude_top_choices(cand, kept, p, coin)
    cdf = np.cumsum(kept)
    return int(cand[min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(kept) - 1)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Along the last axis, in float32."""
    raw = logits - logits.max(axis=-1, keepdims=True)
    return raw - np.log(np.exp(raw).sum(axis=-1, keepdims=True))


def most_likely(lsm: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely (token id, logprob) of one row, ties to the lower id."""
    if not n:
        return []
    best = np.argpartition(-lsm, n - 1)[:n]
    best = best[np.lexsort((best, -lsm[best]))]
    return [(int(t), float(lsm[t])) for t in best]
