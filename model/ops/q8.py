"""8-bit weights for the CPU backend: llama.cpp's Q8_0 layout, 32 int8 values and one float32
scale per block along each weight row (8.5 bits a weight; float32 is 32).

A decode step at batch 1 reads every weight once, so it is bound by memory bandwidth: a quarter
of the bytes makes it faster. Up to GEMV_ROWS rows a step runs a GEMV kernel over the 8-bit
blocks, four weight rows at a time sharing each activation load (the loop shape that let LLVM
vectorise it); each further row costs about a third of the first, since the weights are read
from cache by then. With more rows, each weight is widened back to float32 a slab of rows at a
time, into a buffer that stays in cache, and OpenBLAS multiplies the slab. Measured on the
default model (tools/bench_model.py, tok/s): GEMV 153 / 173 / 181 at 8 / 16 / 32 rows against
slabs 72 / 110 / 158; at 64 rows slabs 244 against GEMV 190.
"""

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

BLOCK = 32
GEMV_ROWS = 32  # up to this many activation rows, the 8-bit GEMV; above, slabs and BLAS
SLAB_ROWS = 512  # weight rows widened at a time: 512 x 1536 float32 is 3 MB


@dataclass
class Q8Weight:
    q: np.ndarray  # (out, in) int8
    scale: np.ndarray  # (out, in // BLOCK) float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def quantizable(w: np.ndarray) -> bool:
    return w.ndim == 2 and w.shape[1] % BLOCK == 0


def quantize(w: np.ndarray) -> Q8Weight:
    """Round to nearest, each block scaled so that its largest magnitude is 127."""
    out_dim, in_dim = w.shape
    blocks = np.asarray(w, dtype=np.float32).reshape(out_dim, in_dim // BLOCK, BLOCK)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.rint(blocks / safe[..., None]).astype(np.int8).reshape(out_dim, in_dim)
    return Q8Weight(np.ascontiguousarray(q), np.ascontiguousarray(scale, dtype=np.float32))


def dequantize(w: Q8Weight, rows=slice(None)) -> np.ndarray:
    q, scale = w.q[rows], w.scale[rows]
    return (q.reshape(q.shape[0], -1, BLOCK) * scale[..., None]).reshape(q.shape).astype(np.float32)


@njit("void(float32[:, ::1], int8[:, ::1], float32[:, ::1], float32[:, ::1])",
      parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv(x, q, scale, out):
    """out = x @ dequantize(q, scale).T for a few rows of x: four weight rows per iteration."""
    tokens, in_dim = x.shape
    out_dim = q.shape[0]
    blocks = in_dim // 32
    for tile in prange((out_dim + 3) // 4):
        n0 = tile * 4
        if n0 + 4 > out_dim:  # the ragged end, one row at a time
            for n in range(n0, out_dim):
                for t in range(tokens):
                    total = np.float32(0.0)
                    for b in range(blocks):
                        s = np.float32(0.0)
                        for j in range(32):
                            s += q[n, b * 32 + j] * x[t, b * 32 + j]
                        total += s * scale[n, b]
                    out[t, n] = total
            continue
        for t in range(tokens):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for b in range(blocks):
                s0 = np.float32(0.0)
                s1 = np.float32(0.0)
                s2 = np.float32(0.0)
                s3 = np.float32(0.0)
                for j in range(32):
                    v = x[t, b * 32 + j]
                    s0 += q[n0, b * 32 + j] * v
                    s1 += q[n0 + 1, b * 32 + j] * v
                    s2 += q[n0 + 2, b * 32 + j] * v
                    s3 += q[n0 + 3, b * 32 + j] * v
                a0 += s0 * scale[n0, b]
                a1 += s1 * scale[n0 + 1, b]
                a2 += s2 * scale[n0 + 2, b]
                a3 += s3 * scale[n0 + 3, b]
            out[t, n0] = a0
            out[t, n0 + 1] = a1
            out[t, n0 + 2] = a2
            out[t, n0 + 3] = a3


@njit("void(int8[:, ::1], float32[:, ::1], int64, float32[:, ::1])", parallel=True, fastmath=True, cache=True, nogil=True)
def _widen(q, scale, start, out):
    """out[i] = row start + i of the weight, in float32 (one core: OpenBLAS has the other's turn next)."""
    rows, in_dim = out.shape
    for i in prange(rows):
        for b in range(in_dim // 32):
            s = scale[start + i, b]
            for j in range(32):
                out[i, b * 32 + j] = q[start + i, b * 32 + j] * s


_slab = np.empty(0, dtype=np.float32)


def matmul(x: np.ndarray, w: Q8Weight) -> np.ndarray:
    """x @ w.T for activations x (tokens, in), as float32 (tokens, out)."""
    global _slab
    x = np.ascontiguousarray(x, dtype=np.float32)
    out_dim, in_dim = w.shape
    out = np.empty((x.shape[0], out_dim), dtype=np.float32)
    if x.shape[0] <= GEMV_ROWS:
        _gemv(x, w.q, w.scale, out)
        return out
    if _slab.size < SLAB_ROWS * in_dim:
        _slab = np.empty(SLAB_ROWS * in_dim, dtype=np.float32)
    for start in range(0, out_dim, SLAB_ROWS):
        rows = min(SLAB_ROWS, out_dim - start)
        slab = _slab[:rows * in_dim].reshape(rows, in_dim)
        _widen(w.q, w.scale, start, slab)
        np.matmul(x, slab.T, out=out[:, start:start + rows])
    return out
