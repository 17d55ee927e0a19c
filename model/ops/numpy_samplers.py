"""The NumPy reference of the penalties, and of the samplers beyond the kernels'
(model/sampling.py SamplingParams.extended): vLLM's allowed_token_ids and bad_words, and llama.cpp's dynamic temperature, locally typical
sampling and XTC, each as llama.cpp (or vLLM) defines it. numpy_sampling.pick calls them in
Spool's order, vLLM's: temperature first (llama-server's default chain applies it last), then
top-k, typical, top-p, min-p and top-nσ, XTC last.

The kept candidates travel as (ids, probabilities): ids in the canonical order (probability
descending, then id), probabilities renormalised over them.
"""

import numpy as np

from model.sampling import SamplingParams


def restrict(logits: np.ndarray, p: SamplingParams, output_ids) -> None:
    """In place: -inf for a token allowed_token_ids leaves out, and for a bad word's last token
    when the output ends with the rest of it (vLLM's: over the generated tokens only)."""
    if p.allowed_token_ids is not None:
        allowed = np.zeros(logits.shape[0], dtype=bool)
        allowed[list(p.allowed_token_ids)] = True
        logits[~allowed] = -np.inf
    tail = list(output_ids)
    for word in p.bad_words:
        before = list(word[:-1])
        if not before or tail[-len(before):] == before:
            logits[word[-1]] = -np.inf


def penalty_window(p: SamplingParams, prompt_ids, output_ids) -> tuple:
    """The prompt and output tokens the penalties look at: llama-server's last penalty_last_n of
    the whole context (-1: all of it)."""
    n = p.penalty_last_n
    if n < 0:
        return prompt_ids, output_ids
    output = list(output_ids)[-n:]
    left = n - len(output)
    return (list(prompt_ids)[-left:] if left else []), output


def apply_penalties(logits: np.ndarray, p: SamplingParams, prompt_ids, output_ids) -> None:
    """In place: repetition over prompt and output (transformers'), presence and frequency over
    the output (OpenAI's); within llama-server's penalty_last_n, when the request sets one."""
    vocab = logits.shape[0]
    prompt_ids, output_ids = penalty_window(p, prompt_ids, output_ids)
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


def dynamic_temperature(logits: np.ndarray, p: SamplingParams) -> float:
    """llama.cpp's temp_ext: with a range, the temperature moves within temperature +- range
    (floored at 0) with the row's normalised entropy at temperature 1 raised to the exponent:
    a confident row is sampled colder, an unsure one hotter. The row's finite logits count."""
    if p.dynatemp_range <= 0:
        return p.temperature
    finite = logits[np.isfinite(logits)].astype(np.float64)
    if len(finite) <= 1:
        return p.temperature
    probs = np.exp(finite - finite.max())
    probs /= probs.sum()
    probs = probs[probs > 0]
    entropy = -(probs * np.log(probs)).sum()
    low, high = max(0.0, p.temperature - p.dynatemp_range), p.temperature + p.dynatemp_range
    return float(low + (high - low) * (entropy / np.log(len(finite))) ** p.dynatemp_exponent)


def locally_typical(cand: np.ndarray, kept: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray]:
    """Locally typical sampling (Meister et al.; llama.cpp's typical): the tokens whose surprise
    -log p is nearest the distribution's entropy, taken until their mass passes `mass` (the one
    that passes it kept)."""
    entropy = -(kept * np.log(kept)).sum()
    distance = np.abs(-np.log(kept) - entropy)
    by_distance = np.argsort(distance, kind="stable")  # ties: canonical order
    passed = np.flatnonzero(np.cumsum(kept[by_distance]) > mass)
    chosen = np.sort(by_distance[:passed[0] + 1 if len(passed) else len(kept)])  # back to canonical order
    return cand[chosen], kept[chosen] / kept[chosen].sum()


def exclude_top_choices(cand: np.ndarray, kept: np.ndarray, p: SamplingParams,
                        coin: float) -> tuple[np.ndarray, np.ndarray]:
    """XTC (llama.cpp's xtc): with probability xtc_probability (coin below it), every token at
    or above xtc_threshold (of the candidates' renormalised mass) but the least likely of them is
    removed, when at least two are."""
    if coin >= p.xtc_probability or len(kept) < 2:
        return cand, kept
    kept = kept / kept.sum()
    above = int((kept >= p.xtc_threshold).sum())  # a prefix: kept is in descending order
    if above < 2:
        return cand, kept
    return cand[above - 1:], kept[above - 1:] / kept[above - 1:].sum()


def mirostat_v2(logits: np.ndarray, p: SamplingParams, u: float) -> tuple[int, float]:
    """Mirostat 2 (Basu et al.; llama.cpp's mirostat_v2), in place of the truncating filters:
    at the temperature, only the tokens of surprise -log2 p at most mu (the most likely one at
    least), renormalised; then mu moves by eta times the error of the drawn token's surprise
    (under the renormalised distribution) against tau. Returns the token and the new mu."""
    mu = 2 * p.mirostat_tau if p.mirostat_mu is None else p.mirostat_mu
    scaled = (logits / np.float32(p.temperature)).astype(np.float64)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    cand = np.flatnonzero(probs >= 2.0 ** -mu)  # surprise <= mu
    if not len(cand):
        cand = np.array([int(np.argmax(probs))])
    cand = cand[np.lexsort((cand, -probs[cand]))]
    kept = probs[cand] / probs[cand].sum()
    cdf = np.cumsum(kept)
    at = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(kept) - 1)
    return int(cand[at]), float(mu - p.mirostat_eta * (-np.log2(kept[at]) - p.mirostat_tau))
