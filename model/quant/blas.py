"""x @ w.T for many activation rows on the portable path (no AVX-512): Q8_0 strips widened to
float32 a slab at a time, each slab one OpenBLAS GEMM. Its bits depend on the row count, as
OpenBLAS's do."""

import numpy as np
from numba import njit, prange

from model.quant.strips import STRIP, Q8_0Strips

SLAB_ROWS = 512  # weight rows widened at a time: 512 x 1536 float32 is 3 MB
_slab = np.empty(0, dtype=np.float32)


def blas_matmul(x: np.ndarray, w: Q8_0Strips) -> np.ndarray:
    """x @ w.T over every strip (rows past w's last included), for C-ordered float32 x."""
    global _slab
    strips, in_dim = w.q.shape[0], w.shape[1]
    out = np.empty((x.shape[0], strips * STRIP), dtype=np.float32)
    if _slab.size < SLAB_ROWS * in_dim:
        _slab = np.empty(SLAB_ROWS * in_dim, dtype=np.float32)
    for first in range(0, strips, SLAB_ROWS // STRIP):
        count = min(SLAB_ROWS // STRIP, strips - first)
        slab = _slab[:count * STRIP * in_dim].reshape(count * STRIP, in_dim)
        _widen(w.q, w.factors, first, slab)
        start = first * STRIP
        np.matmul(x, slab.T, out=out[:, start:start + count * STRIP])
    return out


@njit("void(int8[:, :, ::1], float32[:, :, ::1], int64, float32[:, ::1])",
      parallel=True, fastmath=True, cache=True, nogil=True)
def _widen(q, scale, first, out):
    """out[16i + n] = row n of strip first + i, in float32 (the strips that fit out)."""
    blocks = q.shape[1]
    for i in prange(out.shape[0] // 16):
        s = first + i
        for b in range(blocks):
            for r in range(16):
                for n in range(16):
                    out[i * 16 + n, b * 32 + 2 * r] = q[s, b, r * 32 + 2 * n] * scale[s, b, n]
                    out[i * 16 + n, b * 32 + 2 * r + 1] = q[s, b, r * 32 + 2 * n + 1] * scale[s, b, n]
