"""The NumPy reference sampler's arithmetic, row by row: penalties and logit bias on the
logits, the kept set (top-k, top-p, min-p, top-nσ) and the inverse-CDF draw, and logprobs.
NumpyOps.sample runs it; the CPU's numba sampler and the CUDA kernels are held to it.
"""

import numpy as np

from model.sampling import SamplingParams

# Candidates kept for top-k / top-p before falling back to a full sort of the vocabulary.
SAMPLING_CANDIDATES = 256


def apply_penalties(logits: np.ndarray, p: SamplingParams, prompt_ids, output_ids) -> None:
    """In place: repetition over prompt and output (transformers'), presence and frequency over
    the output (OpenAI's)."""
    vocab = logits.shape[0]
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(prompt_ids, dtype=np.int64),
                                         np.asarray(output_ids, dtype=np.int64)]))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / np.float32(p.repetition_penalty),
                                vals * np.float32(p.repetition_penalty))
    if (p.presence_penalty or p.frequency_penalty) and len(output_ids):
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab).astype(np.float32)
        logits -= np.float32(p.frequency_penalty) * counts
        logits -= np.float32(p.presence_penalty) * (counts > 0)


def sigma_floor(logits: np.ndarray, p: SamplingParams) -> float:
    """Top-nσ's floor on a token's probability relative to the most likely: exp(-nσ / T), σ the
    standard deviation of the row's finite logits (0 when off)."""
    if p.top_n_sigma <= 0:
        return 0.0
    finite = logits[np.isfinite(logits)].astype(np.float64)
    below = finite - finite.max()
    sigma = np.sqrt(max(np.mean(below * below) - np.mean(below) ** 2, 0.0))
    return float(np.exp(-p.top_n_sigma * sigma / p.temperature))


def pick(logits: np.ndarray, p: SamplingParams, u: float) -> int:
    """Draw one token by inverse CDF over the kept candidates, taken in a canonical order
    (probability descending, then token id), so the draw depends only on logits and u.

    Filters: top-k, then top-p over the renormalized top-k, and a floor relative to the most
    likely token: min-p's, and top-nσ's (a logit n standard deviations below the largest, its
    weight at the temperature). Only the candidates are sorted, never the whole vocabulary
    unless top-p needs more than SAMPLING_CANDIDATES tokens."""
    scaled = logits / np.float32(p.temperature)
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    vocab = probs.shape[0]
    top_k = p.top_k if 0 < p.top_k < vocab else 0
    floor = max(p.min_p, sigma_floor(logits, p))
    if not top_k and p.top_p >= 1.0 and floor <= 0.0:
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), vocab - 1))
    if floor > 0.0:
        cand = np.flatnonzero(probs >= floor * probs.max())
    elif top_k:
        cand = np.argpartition(-probs, top_k - 1)[:top_k]
    else:  # top-p alone: the nucleus is usually small
        n = min(SAMPLING_CANDIDATES, vocab)
        cand = np.argpartition(-probs, n - 1)[:n]
        if probs[cand].sum() < p.top_p:
            cand = np.arange(vocab)
    cand = cand[np.lexsort((cand, -probs[cand]))]
    if top_k:
        cand = cand[:top_k]
    kept = probs[cand] / probs[cand].sum()
    if p.top_p < 1.0:
        before = np.cumsum(kept) - kept
        kept = kept[before < p.top_p]
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
