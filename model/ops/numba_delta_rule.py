"""The two steps of a delta-net layer that carry state (model/ops/delta_rule.py holds the
reference and the rest of the layer), as numba kernels: the short causal convolution, a job per
row and block of channels, and the gated delta rule, a job per row and value head, each walking
its row's tokens in order, so that a row's state and outputs never depend on its neighbours or
on how its prompt was chunked."""

import numpy as np
from numba import prange

from model.ops.numba_kernels import F2, F3, F4, I1, kernel

CHANNELS = 64  # a convolution job's channels: a row's tokens walked once per block


@kernel(f"void({F2}, {F3}, {F2}, {I1}, {I1}, {I1}, {F2})")
def _convolve(x, history, weight, starts, counts, slots, out):
    channels, taps = weight.shape
    blocks = (channels + CHANNELS - 1) // CHANNELS
    for job in prange(len(starts) * blocks):
        r, first = job // blocks, (job % blocks) * CHANNELS
        width = min(CHANNELS, channels - first)
        start, count, slot = starts[r], counts[r], slots[r]
        before = np.empty((taps - 1, width), dtype=np.float32)  # the history as it was: overwritten below
        for j in range(taps - 1):
            for c in range(width):
                before[j, c] = history[slot, j, first + c]
        for t in range(count):
            for c in range(width):
                acc = np.float32(0.0)
                for tap in range(taps):
                    at = t + tap  # in the history, then in the row's tokens
                    value = before[at, c] if at < taps - 1 else x[start + at - (taps - 1), first + c]
                    acc += value * weight[first + c, tap]
                out[start + t, first + c] = acc / (np.float32(1.0) + np.exp(-acc))
        for j in range(taps - 1):
            at = count + j
            for c in range(width):
                history[slot, j, first + c] = before[at, c] if at < taps - 1 else x[start + at - (taps - 1), first + c]


@kernel(f"void({F3}, {F3}, {F3}, {F2}, {F2}, {F4}, {I1}, {I1}, {I1}, {F3})")
def _recur(q, k, v, g, beta, state, starts, counts, slots, out):
    heads, key_dim, value_dim = v.shape[1], q.shape[2], v.shape[2]
    for job in prange(len(starts) * heads):
        r, h = job // heads, job % heads
        s = state[slots[r], h]
        held = np.empty(value_dim, dtype=np.float32)
        for t in range(starts[r], starts[r] + counts[r]):
            decay, strength = np.exp(g[t, h]), beta[t, h]
            held[:] = 0.0
            for i in range(key_dim):  # decay, and read what the state holds for k
                ki = k[t, h, i]
                for j in range(value_dim):
                    s[i, j] *= decay
                    held[j] += s[i, j] * ki
            for j in range(value_dim):
                held[j] = (v[t, h, j] - held[j]) * strength
            for j in range(value_dim):
                out[t, h, j] = 0.0
            for i in range(key_dim):  # write toward v under k, and read under q
                ki, qi = k[t, h, i], q[t, h, i]
                for j in range(value_dim):
                    s[i, j] += ki * held[j]
                    out[t, h, j] += s[i, j] * qi


def convolve_rows(x: np.ndarray, history: np.ndarray, weight: np.ndarray, rows) -> np.ndarray:
    """delta_rule.convolve_rows, compiled."""
    x = np.ascontiguousarray(x)
    out = np.empty(x.shape, dtype=np.float32)
    _convolve(x.size * weight.shape[1], x, history, weight, rows.starts, rows.counts, rows.slots, out)
    return out


def delta_rule_rows(q, k, v, g, beta, state: np.ndarray, rows) -> np.ndarray:
    """delta_rule.delta_rule_rows, compiled."""
    out = np.empty(v.shape, dtype=np.float32)
    _recur(v.size * q.shape[2], q, k, v, np.ascontiguousarray(g), np.ascontiguousarray(beta), state,
           rows.starts, rows.counts, rows.slots, out)
    return out
