"""x @ w.T for many activation rows on the portable path (no AVX-512): strips widened to
float32 a slab at a time (each weight as dequantize computes it), each slab one OpenBLAS GEMM.
Its bits depend on the row count, as OpenBLAS's do."""

import numpy as np
from numba import prange

from model.quant.gemv import block_factor, compiled, line_value
from model.quant.strips import SCHEMES, STRIP, Strips

SLAB_ROWS = 512  # weight rows widened at a time: 512 x 1536 float32 is 3 MB
_slab = np.empty(0, dtype=np.float32)


def blas_matmul(x: np.ndarray, w: Strips) -> np.ndarray:
    """x @ w.T over every strip (rows past w's last included), for C-ordered float32 x."""
    global _slab
    strips, in_dim = w.q.shape[0], w.shape[1]
    out = np.empty((x.shape[0], strips * STRIP), dtype=np.float32)
    if _slab.size < SLAB_ROWS * in_dim:
        _slab = np.empty(SLAB_ROWS * in_dim, dtype=np.float32)
    for first in range(0, strips, SLAB_ROWS // STRIP):
        count = min(SLAB_ROWS // STRIP, strips - first)
        slab = _slab[:count * STRIP * in_dim].reshape(count * STRIP, in_dim)
        _WIDEN[type(w)](w.q, w.factors, first, slab)
        start = first * STRIP
        np.matmul(x, slab.T, out=out[:, start:start + count * STRIP])
    return out


def _widen_kernel(weights: type[Strips]):
    """The widening for one scheme; no fastmath, so that each weight is the one dequantize computes."""
    nibbles, high_bits, zero, scales, minima = (weights.NIBBLES, weights.HIGH_BITS, weights.ZERO, weights.SCALES,
                                                weights.MINIMA)
    sub_scales, signed, ints_at = weights.SUB_SCALES, weights.SIGNED, weights.BLOCK_BYTES - weights.FACTORS

    def widen(q, factors, first, out):
        """out[16i + n] = row n of strip first + i, in float32 (the strips that fit out)."""
        blocks = q.shape[1]
        for i in prange(out.shape[0] // 16):
            s = first + i
            for b in range(blocks):
                for r in range(16):
                    g = r * scales // 16
                    for n in range(16):
                        for j in range(2):
                            value = np.float32(line_value(q, s, b, r, 2 * n + j, nibbles, high_bits, zero))
                            w = value * block_factor(q, factors, s, b, 16 * g + n, sub_scales, signed, ints_at)
                            if minima:
                                w += block_factor(q, factors, s, b, 16 * scales + n, sub_scales, signed, ints_at)
                            out[i * 16 + n, b * 32 + 2 * r + j] = w
    return compiled(widen, "void(int8[:, :, ::1], float32[:, :, ::1], int64, float32[:, ::1])", weights)


_WIDEN = {weights: _widen_kernel(weights) for weights in SCHEMES.values()}
