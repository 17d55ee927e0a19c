"""LoRA's two small products per token (model/lora.py), each token reading its own adapter's
slot: the CPU's form of Punica's BGMV. One token's sums run in one fixed order whatever else
the step holds, so a row's output is the same bits alone and in a batch."""

import numpy as np
from numba import prange

from model.ops.numba_kernels import F1, F2, F3, kernel


@kernel(f"void({F2}, {F2}, {F3}, {F3}, int32[::1], {F1}, int64)")
def _lora(y, x, a, b, slots, scales, first):
    tokens, width = x.shape
    rank, out = a.shape[1], b.shape[1]
    for t in prange(tokens):
        s = slots[t]
        if s < 0:
            continue
        shrunk = np.empty(rank, np.float32)
        for r in range(rank):
            total = np.float32(0.0)
            for k in range(width):
                total += a[s, r, k] * x[t, k]
            shrunk[r] = total * scales[t]
        for o in range(out):
            total = np.float32(0.0)
            for r in range(rank):
                total += b[s, o, r] * shrunk[r]
            y[t, first + o] += total


def lora(y: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, slots: np.ndarray, scales: np.ndarray,
         first: int) -> np.ndarray:
    """y[t, first:first + out] += scales[t] * b[s] @ (a[s] @ x[t]) for each token t with a slot
    s = slots[t] >= 0: y in place (a C-contiguous copy where it is not), returned."""
    y = np.ascontiguousarray(y)
    adapted = int(np.count_nonzero(slots >= 0))
    _lora(adapted * a.shape[1] * (a.shape[2] + b.shape[1]), y, np.ascontiguousarray(x, np.float32), a, b, slots,
          scales, first)
    return y
