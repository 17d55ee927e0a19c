"""8-bit weights for the CPU backend: llama.cpp's Q8_0 layout, 32 int8 values and one float32
scale per block along each weight row (8.5 bits a weight; float32 is 32).

A decode step at batch 1 reads every weight once, so it is bound by memory bandwidth: a quarter
of the bytes makes it faster. Up to GEMV_ROWS rows a step runs a GEMV kernel over the 8-bit
blocks: with AVX-512, activations scaled to int16 and one vpmaddwd per block (_dot_pmaddwd);
elsewhere, weights widened to float32 four rows at a time sharing each activation load (_gemv,
the loop shape that let LLVM vectorise it). Each further row costs about a third of the first,
since the weights are read from cache by then. With more rows, each weight is widened back to
float32 a slab of rows at a time, into a buffer that stays in cache, and OpenBLAS multiplies the
slab. Measured on the default model with the float32 GEMV (tools/bench_model.py, tok/s): GEMV 153 / 173 / 181 at
8 / 16 / 32 rows against slabs 72 / 110 / 158; at 64 rows slabs 244 against GEMV 190.
"""

from dataclasses import dataclass

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK = 32
GEMV_ROWS = 32  # up to this many activation rows, the 8-bit GEMV; above, slabs and BLAS
SLAB_ROWS = 512  # weight rows widened at a time: 512 x 1536 float32 is 3 MB
# With AVX-512, the GEMV scales the activations to int16 per block and multiplies them with the
# int8 weights through vpmaddwd: 25-30% faster than widening the weights to float32. (int8
# activations, as llama.cpp's Q8_0 dot uses, were as fast but cut the top-1 agreement with
# float32 from 98.25% to 96.35%; int16 ones lose nothing measurable.)
PMADDWD = "+avx512bw" in llvm.get_host_cpu_features().flatten().split(",")


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


@njit("void(int8[:, ::1], float32[:, ::1], int64, float32[:, ::1])",
      parallel=True, fastmath=True, cache=True, nogil=True)
def _widen(q, scale, start, out):
    """out[i] = row start + i of the weight, in float32."""
    rows, in_dim = out.shape
    for i in prange(rows):
        for b in range(in_dim // 32):
            s = scale[start + i, b]
            for j in range(32):
                out[i, b * 32 + j] = q[start + i, b * 32 + j] * s


@intrinsic
def _dot_pmaddwd(typingctx, q, n, xq, t, qs, xs):
    """Sum over the blocks b of row n: (q[n, b] . xq[t, b]) * qs[n, b] * xs[t, b], each block's
    32 int8 weights (widened) and int16 activations through one vpmaddwd, the scaled partial
    sums kept in 16 float lanes."""
    def codegen(context, builder, signature, args):
        q_arr, xq_arr, qs_arr, xs_arr = (context.make_array(signature.args[i])(context, builder, args[i])
                                         for i in (0, 2, 4, 5))
        n, t = args[1], args[3]
        i64, i32 = ir.IntType(64), ir.IntType(32)
        in_dim = builder.extract_value(q_arr.shape, 1)
        blocks = builder.sdiv(in_dim, ir.Constant(i64, 32))
        q_row = builder.gep(q_arr.data, [builder.mul(n, in_dim)])
        x_row = builder.gep(xq_arr.data, [builder.mul(t, in_dim)])
        qs_row = builder.gep(qs_arr.data, [builder.mul(n, blocks)])
        xs_row = builder.gep(xs_arr.data, [builder.mul(t, blocks)])
        bytes32, shorts32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 32)
        i16 = ir.IntType(16)
        ints16, floats16 = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ints16, [shorts32, shorts32]),
                                                 "llvm.x86.avx512.pmaddw.d.512")
        acc = cgutils.alloca_once_value(builder, ir.Constant(floats16, None))
        with cgutils.for_range(builder, blocks) as loop:
            offset = builder.mul(loop.index, ir.Constant(i64, 32))

            weights = builder.sext(builder.load(builder.bitcast(builder.gep(q_row, [offset]), bytes32.as_pointer()),
                                                align=1), shorts32)
            activations = builder.load(builder.bitcast(builder.gep(x_row, [offset]), shorts32.as_pointer()), align=2)
            products = builder.sitofp(builder.call(pmaddwd, [weights, activations]), floats16)
            scale = builder.fmul(builder.load(builder.gep(qs_row, [loop.index])),
                                 builder.load(builder.gep(xs_row, [loop.index])))
            lanes = builder.insert_element(ir.Constant(floats16, None), scale, ir.Constant(i32, 0))
            lanes = builder.shuffle_vector(lanes, lanes, ir.Constant(ints16, [0] * 16))
            builder.store(builder.fadd(builder.load(acc), builder.fmul(products, lanes)), acc)
        total, vector = ir.Constant(ir.FloatType(), 0.0), builder.load(acc)
        for lane in range(16):
            total = builder.fadd(total, builder.extract_element(vector, ir.Constant(i32, lane)))
        return total
    return types.float32(q, n, xq, t, qs, xs), codegen


@njit("void(float32[:, ::1], int16[:, ::1], float32[:, ::1])", fastmath=True, cache=True, nogil=True)
def _scale_to_int16(x, xq, xs):
    """Activations to int16 blocks of 32 with one scale each, rounded to nearest."""
    tokens, in_dim = x.shape
    for t in range(tokens):
        for b in range(in_dim // 32):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[t, b * 32 + j]))
            s = top / np.float32(32767.0)
            xs[t, b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for j in range(32):
                xq[t, b * 32 + j] = np.int16(np.rint(x[t, b * 32 + j] * inv))


def _pmaddwd_gemv_kernel():
    @njit("void(int16[:, ::1], float32[:, ::1], int8[:, ::1], float32[:, ::1], float32[:, ::1])",
          parallel=True, fastmath=True, cache=True, nogil=True)
    def gemv(xq, xs, q, qs, out):
        for n in prange(q.shape[0]):
            for t in range(xq.shape[0]):
                out[t, n] = _dot_pmaddwd(q, n, xq, t, qs, xs)
    return gemv


_pmaddwd_gemv = _pmaddwd_gemv_kernel() if PMADDWD else None  # compiled only where the instruction exists
_slab = np.empty(0, dtype=np.float32)


def matmul(x: np.ndarray, w: Q8Weight) -> np.ndarray:
    """x @ w.T for activations x (tokens, in), as float32 (tokens, out)."""
    global _slab
    x = np.ascontiguousarray(x, dtype=np.float32)
    out_dim, in_dim = w.shape
    out = np.empty((x.shape[0], out_dim), dtype=np.float32)
    if x.shape[0] <= GEMV_ROWS:
        if PMADDWD:
            xq = np.empty(x.shape, dtype=np.int16)
            xs = np.empty((x.shape[0], in_dim // BLOCK), dtype=np.float32)
            _scale_to_int16(x, xq, xs)
            _pmaddwd_gemv(xq, xs, w.q, w.scale, out)
        else:
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
