"""llama-server's sampler chain (a request's `samplers`), the NumPy reference: the stages it
names, in its order, each on the candidates the ones before it left, as llama.cpp's sampler
chain runs them; a stage not named is not applied (llama.cpp's default chain puts temperature
last, after the filters; Spool's own order, numpy_sampling.pick, puts it first, as vLLM does).

Candidates travel as (ids, logits): a filter keeps some, temperature, penalties and DRY change
the logits; probabilities are the softmax of the current logits. Then one inverse-CDF draw in
the canonical order (probability descending, then id). Temperature 0 keeps the most likely
token alone, and a greedy row draws u = 0, so it is greedy whatever the chain.
"""

import numpy as np

from model.ops.numpy_dry import apply_dry
from model.ops.numpy_samplers import apply_penalties, dynamic_temperature, exclude_top_choices, locally_typical
from model.sampling import SamplingParams


def chain_draw(logits: np.ndarray, p: SamplingParams, prompt_ids, output_ids, u: float, coin: float) -> int:
    """One token of a row (its bias, mask and bans already on logits) through p.samplers."""
    ids = np.flatnonzero(logits > -np.inf)
    if not len(ids):
        return int(np.argmax(logits))
    values = logits[ids].astype(np.float32)
    for stage in p.samplers:
        ids, values = STAGES[stage](ids, values, p, logits.shape[0], prompt_ids, output_ids, coin)
    order = np.lexsort((ids, -values))
    ids, probs = ids[order], softmax(values[order])
    cdf = np.cumsum(probs)
    return int(ids[min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(ids) - 1)])


def softmax(values: np.ndarray) -> np.ndarray:
    e = np.exp((values - values.max()).astype(np.float64))
    return e / e.sum()


def ranked(ids, values):
    """The candidates in canonical order, with their probabilities."""
    order = np.lexsort((ids, -values))
    return order, softmax(values[order])


def _whole_row(fn):
    """A stage that changes logits over the whole vocabulary (penalties, DRY), on the candidates."""
    def stage(ids, values, p, vocab, prompt_ids, output_ids, coin):
        row = np.full(vocab, -np.inf, dtype=np.float32)
        row[ids] = values
        fn(row, p, prompt_ids, output_ids)
        return ids, row[ids]
    return stage


def temperature(ids, values, p, *_):
    t = dynamic_temperature(values, p)
    if t <= 0:
        best = np.lexsort((ids, -values))[:1]
        return ids[best], values[best]
    return ids, values / np.float32(t)


def top_k(ids, values, p, *_):
    if not 0 < p.top_k < len(ids):
        return ids, values
    keep = np.lexsort((ids, -values))[:p.top_k]
    return ids[keep], values[keep]


def top_p(ids, values, p, *_):
    if p.top_p >= 1.0:
        return ids, values
    order, probs = ranked(ids, values)
    keep = order[np.cumsum(probs) - probs < p.top_p]
    return ids[keep], values[keep]


def min_p(ids, values, p, *_):
    if p.min_p <= 0.0:
        return ids, values
    probs = softmax(values)
    keep = probs >= p.min_p * probs.max()
    return ids[keep], values[keep]


def typical(ids, values, p, *_):
    if p.typical_p >= 1.0:
        return ids, values
    order, probs = ranked(ids, values)
    kept_ids, _ = locally_typical(order, probs, p.typical_p)
    return ids[kept_ids], values[kept_ids]


def xtc(ids, values, p, vocab, prompt_ids, output_ids, coin):
    if not p.excludes_top_choices:
        return ids, values
    order, probs = ranked(ids, values)
    kept, _ = exclude_top_choices(order, probs, p, coin)
    return ids[kept], values[kept]


def top_n_sigma(ids, values, p, *_):
    if p.top_n_sigma <= 0 or len(values) < 2:
        return ids, values
    v = values.astype(np.float64)
    keep = v >= v.max() - p.top_n_sigma * v.std()
    return ids[keep], values[keep]


STAGES = {"penalties": _whole_row(apply_penalties), "dry": _whole_row(apply_dry), "temperature": temperature,
          "top_k": top_k, "top_p": top_p, "min_p": min_p, "typ_p": typical, "xtc": xtc, "top_n_sigma": top_n_sigma}
