"""DRY, "don't repeat yourself" (p-e-w's sampler, as llama.cpp's dry): a token that would
continue a sequence already seen in the context is penalised, more the longer the repeat.

For each place the context's tail was seen before, the token that followed it there gets
multiplier * base ** (length - allowed_length) off its logit, length being how far the tail
matches backwards from there (at least allowed_length to count), stopped at a sequence
breaker. The matches come from one Z-function over the reversed context, as llama.cpp finds
them, so a step costs time linear in the window.
"""

import math

import numpy as np

from model.sampling import SamplingParams

FLOAT_MAX_LOG = 88.7228391  # llama.cpp's bound on base ** exponent: a penalty stays a finite float32


def apply_dry(logits: np.ndarray, p: SamplingParams, prompt_ids, output_ids) -> None:
    """In place, on the logits before the temperature (where the penalties go)."""
    if not p.dry:
        return
    context = [*prompt_ids, *output_ids]
    if p.dry_penalty_last_n > 0:
        context = context[-p.dry_penalty_last_n:]
    breakers = set(p.dry_sequence_breakers)
    free = 0  # the tail's tokens back to the last breaker: no repeat reaches past them
    for token in reversed(context):
        if token in breakers:
            break
        free += 1
    n = len(context)
    if not free:
        return
    matched = z_function(context[::-1])
    longest: dict[int, int] = {}
    for i in range(1, n):  # context[i] followed a stretch that matches the tail backwards from context[i - 1]
        length, token = min(matched[n - i], free), context[i]
        if length and token not in breakers and length > longest.get(token, 0):
            longest[token] = length
    max_exponent = int(FLOAT_MAX_LOG / math.log(p.dry_base)) if p.dry_base > 1.000001 else 0
    for token, length in longest.items():
        if length >= p.dry_allowed_length:
            exponent = length - p.dry_allowed_length
            if max_exponent:
                exponent = min(exponent, max_exponent)
            logits[token] -= np.float32(p.dry_multiplier * p.dry_base ** exponent)


def z_function(seq: list) -> list[int]:
    """z[k]: how many items seq[k:] shares with seq from the start (z[0] = 0)."""
    n = len(seq)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and seq[z[k]] == seq[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z
