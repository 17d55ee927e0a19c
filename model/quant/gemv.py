"""x @ w.T for few activation rows (decode), a strip at a time: the activations scaled to int16
through vpmaddwd (AVX-512BW), or the same walk in float32 on any other CPU.

A decode step at batch 1 reads every weight once, so it is bound by memory bandwidth: a quarter
of the bytes makes it faster. Per block, 16 lines of 32 weights (widened to int16) times a
broadcast pair of int16 activations give the 16 rows' int32 sums in 16 lanes, scaled into 16
float lanes by the weight and activation scales.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from model.ops.llvm_ir import array, splat
from model.quant.cpu import PMADDWD
from model.quant.strips import BLOCK, STRIP, Q4_1Strips, Q8_0Strips, Strips, scheme


@intrinsic(prefer_literal=True)
def _strip_dot(typingctx, q, s, xq, t, qs, xs, xsum, out, four_bit):
    """out[t, 16s:16s+16] = strip s times activation row t: per block, 16 lines of 32 weights
    (widened to int16) times a broadcast pair of int16 activations through vpmaddwd, summed in
    int32, then scaled by the weight and activation scales into 16 float lanes. four_bit (a
    literal): Q4_1 strips, each 32-byte line pair split into its two lines of nibbles, and
    each row's minimum times the block's activation sum (xsum) added."""
    if not isinstance(four_bit, types.BooleanLiteral):
        return None
    nibbles = four_bit.literal_value
    block_bytes, factors_per_block = scheme(nibbles).BLOCK_BYTES, scheme(nibbles).FACTORS

    def codegen(context, builder, signature, args):
        q_arr, xq_arr, qs_arr, xs_arr, xsum_arr, out_arr = (
            array(context, builder, signature.args[i], args[i]) for i in (0, 2, 4, 5, 6, 7))
        s, t = args[1], args[3]
        i64, i32, i16 = ir.IntType(64), ir.IntType(32), ir.IntType(16)
        blocks = builder.extract_value(q_arr.shape, 1)
        width = builder.extract_value(out_arr.shape, 1)
        bytes32, shorts32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(i16, 32)
        ints16, floats16 = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ints16, [shorts32, shorts32]),
                                                 "llvm.x86.avx512.pmaddw.d.512")
        q_strip = builder.gep(q_arr.data, [builder.mul(s, builder.mul(blocks, ir.Constant(i64, block_bytes)))])
        x_row = builder.gep(xq_arr.data, [builder.mul(t, builder.mul(blocks, ir.Constant(i64, 32)))])
        qs_strip = builder.gep(qs_arr.data, [builder.mul(s, builder.mul(blocks, ir.Constant(i64, factors_per_block)))])
        xs_row = builder.gep(xs_arr.data, [builder.mul(t, blocks)])
        xsum_row = builder.gep(xsum_arr.data, [builder.mul(t, blocks)])
        acc = cgutils.alloca_once_value(builder, ir.Constant(floats16, None))

        def load_bytes(at):
            return builder.load(builder.bitcast(at, bytes32.as_pointer()), align=1)

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            lines = builder.gep(q_strip, [builder.mul(b, ir.Constant(i64, block_bytes))])
            pairs = builder.bitcast(builder.gep(x_row, [builder.mul(b, ir.Constant(i64, 32))]), i32.as_pointer())
            if nibbles:  # line r: the low (r even) or high nibbles of byte pair r // 2
                both = [load_bytes(builder.gep(lines, [ir.Constant(i64, 32 * p)])) for p in range(8)]
                weights = [builder.zext(builder.and_(both[r // 2], ir.Constant(bytes32, [15] * 32)) if r % 2 == 0
                                        else builder.lshr(both[r // 2], ir.Constant(bytes32, [4] * 32)), shorts32)
                           for r in range(16)]
            else:
                weights = [builder.sext(load_bytes(builder.gep(lines, [ir.Constant(i64, 32 * r)])), shorts32)
                           for r in range(16)]
            ints = ir.Constant(ints16, None)
            for r in range(16):
                pair = splat(builder, builder.load(builder.gep(pairs, [ir.Constant(i64, r)]), align=2), ints16)
                ints = builder.add(ints, builder.call(pmaddwd, [weights[r], builder.bitcast(pair, shorts32)]))
            factors = builder.gep(qs_strip, [builder.mul(b, ir.Constant(i64, factors_per_block))])
            scales = builder.load(builder.bitcast(factors, floats16.as_pointer()), align=4)
            x_scale = splat(builder, builder.load(builder.gep(xs_row, [b])), floats16)
            block = builder.fmul(builder.sitofp(ints, floats16), builder.fmul(scales, x_scale))
            if nibbles:
                minima = builder.gep(factors, [ir.Constant(i64, 16)])
                minima = builder.load(builder.bitcast(minima, floats16.as_pointer()), align=4)
                x_sum = splat(builder, builder.load(builder.gep(xsum_row, [b])), floats16)
                block = builder.fadd(block, builder.fmul(minima, x_sum))
            builder.store(builder.fadd(builder.load(acc), block), acc)
        dest = builder.gep(out_arr.data, [builder.add(builder.mul(t, width), builder.mul(s, ir.Constant(i64, 16)))])
        builder.store(builder.load(acc), builder.bitcast(dest, floats16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(q, s, xq, t, qs, xs, xsum, out, four_bit), codegen


@njit("void(float32[:, ::1], int16[:, ::1], float32[:, ::1], float32[:, ::1])", fastmath=True, cache=True,
      nogil=True)
def _scale_to_int16(x, xq, xs, xsum):
    """Activations to int16 blocks of 32 with one scale each, rounded to nearest; and each
    block's sum as rounded (for Q4_1's minima)."""
    tokens, in_dim = x.shape
    for t in range(tokens):
        for b in range(in_dim // 32):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[t, b * 32 + j]))
            s = top / np.float32(32767.0)
            xs[t, b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            total = 0
            for j in range(32):
                v = np.int16(np.rint(x[t, b * 32 + j] * inv))
                xq[t, b * 32 + j] = v
                total += v
            xsum[t, b] = total * s


def _pmaddwd_gemv_kernel(weights: type[Strips]):
    """The GEMV compiled for one scheme (its nibbles a literal), under a name of its own: numba's
    cache keys on the name."""
    nibbles = weights.NIBBLES

    def gemv(xq, xs, xsum, q, qs, out):
        for s in prange(q.shape[0]):
            for t in range(xq.shape[0]):
                _strip_dot(q, s, xq, t, qs, xs, xsum, out, nibbles)
    gemv.__name__ = gemv.__qualname__ = f"pmaddwd_gemv_{weights.kind}"
    return njit("void(int16[:, ::1], float32[:, ::1], float32[:, ::1], int8[:, :, ::1], float32[:, :, ::1],"
                " float32[:, ::1])", parallel=True, fastmath=True, cache=True, nogil=True)(gemv)


# compiled only where the instruction exists
_PMADDWD_GEMV = {weights: _pmaddwd_gemv_kernel(weights) for weights in (Q8_0Strips, Q4_1Strips)} if PMADDWD else {}


def pmaddwd_gemv(x: np.ndarray, w: Strips) -> np.ndarray:
    """x @ w.T over every strip (rows past w's last included), for C-ordered float32 x."""
    tokens, in_dim = x.shape
    out = np.empty((tokens, w.q.shape[0] * STRIP), dtype=np.float32)
    xq = np.empty(x.shape, dtype=np.int16)
    xs = np.empty((tokens, in_dim // BLOCK), dtype=np.float32)
    xsum = np.empty((tokens, in_dim // BLOCK), dtype=np.float32)
    _scale_to_int16(x, xq, xs, xsum)
    _PMADDWD_GEMV[type(w)](xq, xs, xsum, w.q, w.factors, out)
    return out


def float_gemv(x: np.ndarray, w: Q8_0Strips) -> np.ndarray:
    """The same in float32, for machines without AVX-512."""
    out = np.empty((x.shape[0], w.q.shape[0] * STRIP), dtype=np.float32)
    _float_gemv(x, w.q, w.factors, out)
    return out


@njit("void(float32[:, ::1], int8[:, :, ::1], float32[:, :, ::1], float32[:, ::1])",
      parallel=True, fastmath=True, cache=True, nogil=True)
def _float_gemv(x, q, scale, out):
    """out = x @ weight.T in float32, a strip at a time."""
    tokens = x.shape[0]
    strips, blocks = q.shape[0], q.shape[1]
    for s in prange(strips):
        for t in range(tokens):
            acc = np.zeros(16, dtype=np.float32)
            part = np.empty(16, dtype=np.float32)
            for b in range(blocks):
                part[:] = 0
                for r in range(16):
                    x0, x1 = x[t, b * 32 + 2 * r], x[t, b * 32 + 2 * r + 1]
                    for n in range(16):
                        part[n] += q[s, b, r * 32 + 2 * n] * x0 + q[s, b, r * 32 + 2 * n + 1] * x1
                for n in range(16):
                    acc[n] += part[n] * scale[s, b, n]
            for n in range(16):
                out[t, s * 16 + n] = acc[n]
