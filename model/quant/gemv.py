"""x @ w.T for packed weights, a strip at a time, in integers: the activations scaled to int16
per block of 32, each weight widened to int16, products summed in pairs into exact int32 sums.
The same kernel serves every row count and every CPU, so a row's output has the same bits
alone, in any batch, and on any machine.

A decode step at batch 1 reads every weight once, so it is bound by memory bandwidth: a quarter
of the bytes makes it faster. Per block, 16 lines of 32 weights (widened to int16) times a
broadcast pair of int16 activations give the 16 rows' int32 sums in 16 lanes, scaled into 16
float lanes by the weight and activation scales. Batches and prefill are compute-bound, so the
rows go two at a time, a block's lines widened once for both: each row's arithmetic is still the
sequence it has alone. The pair sums are plain LLVM vector IR (widen,
multiply, add even and odd lanes), which LLVM's x86 back end turns into pmaddwd at the width
the target has (zmm with AVX-512BW, ymm with AVX2, xmm with SSE2) and other back ends into
their own multiply-adds: no intrinsic, so nothing that a target cannot lower. Each scheme's
kernels are generated from its constants (strips.py: nibbles, high bits, ZERO, SCALES,
MINIMA, SUB_SCALES, SIGNED), compiled under its kind.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from model.ops.llvm_ir import array, splat
from model.quant.strips import BLOCK, NIBBLE_BYTES, SCHEMES, STRIP, SUPER_BLOCKS, Q4_1Strips, Q8_0Strips, Strips


def _line_weights(builder, lines, weights: type[Strips]) -> list[ir.Value]:
    """The 16 lines of a (strip, block) at lines (i8*) as 32 int16 each, less ZERO: Q8_0's int8
    widened; else line r the low (r even) or high nibbles of byte pair r // 2, and above them its
    HIGH_BITS bits, shifted out of its high group's bytes (strips.py)."""
    i64 = ir.IntType(64)
    bytes32, shorts32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 32)

    def load(at):
        return builder.load(builder.bitcast(builder.gep(lines, [ir.Constant(i64, at)]), bytes32.as_pointer()), align=1)

    def bytes_of(value):
        return ir.Constant(bytes32, [value] * 32)

    if not weights.NIBBLES:
        return [builder.sext(load(32 * r), shorts32) for r in range(STRIP)]
    pairs = [load(32 * p) for p in range(STRIP // 2)]
    high_bits = weights.HIGH_BITS
    groups = [load(NIBBLE_BYTES + 32 * g) for g in range(2 * high_bits)]
    out = []
    for r in range(STRIP):
        value = (builder.and_(pairs[r // 2], bytes_of(15)) if r % 2 == 0
                 else builder.lshr(pairs[r // 2], bytes_of(4)))
        if high_bits:
            lines = 8 // high_bits  # that share a byte
            shift = high_bits * (r % lines)
            high = builder.lshr(groups[r // lines], bytes_of(shift)) if shift else groups[r // lines]
            if shift + high_bits < 8:
                high = builder.and_(high, bytes_of((1 << high_bits) - 1))
            value = builder.or_(value, builder.shl(high, bytes_of(4)))
        value = builder.zext(value, shorts32)
        if weights.ZERO:
            value = builder.sub(value, ir.Constant(shorts32, [weights.ZERO] * 32))
        out.append(value)
    return out


def _pair_sums(builder, a: ir.Value, b: ir.Value) -> ir.Value:
    """a[2i] b[2i] + a[2i + 1] b[2i + 1] in int32 for 32 x int16 a and b: pmaddwd's
    arithmetic, exact for Spool's operands (weights within 8 bits, so no sum overflows)."""
    ints32 = ir.VectorType(ir.IntType(32), 32)
    products = builder.mul(builder.sext(a, ints32), builder.sext(b, ints32))
    even, odd = (ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(first, 32, 2))) for first in (0, 1))
    return builder.add(builder.shuffle_vector(products, products, even), builder.shuffle_vector(products, products, odd))


@intrinsic(prefer_literal=True)
def _strip_dot(typingctx, q, s, xq, t, qs, xs, xsum, out, kind, tile):
    """out[t + i, 16s:16s+16] = strip s times activation row t + i for i < tile (1 or 2), for the
    scheme named kind (kind and tile literals): the block's lines widened and its weight factors
    read once for the tile's rows, each row's arithmetic the same sequence as alone (so the same
    bits). Per block, 16 lines of 32 weights (widened to int16, _line_weights) times a broadcast
    pair of int16 activations (_pair_sums), summed in int32 per scale's lines,
    each sum scaled by the weight and activation scales into 16 float lanes, in line order;
    with MINIMA, each row's minimum times the block's activation sum (xsum) added last."""
    if not isinstance(kind, types.StringLiteral) or not isinstance(tile, types.IntegerLiteral):
        return None
    weights, rows = SCHEMES[kind.literal_value], tile.literal_value
    block_bytes, factors_per_block, scales = weights.BLOCK_BYTES, weights.FACTORS, weights.SCALES

    def codegen(context, builder, signature, args):
        q_arr, xq_arr, qs_arr, xs_arr, xsum_arr, out_arr = (
            array(context, builder, signature.args[i], args[i]) for i in (0, 2, 4, 5, 6, 7))
        s, t = args[1], args[3]
        i64, i32, i16 = ir.IntType(64), ir.IntType(32), ir.IntType(16)
        blocks = builder.extract_value(q_arr.shape, 1)
        width = builder.extract_value(out_arr.shape, 1)
        shorts32 = ir.VectorType(i16, 32)
        ints16, floats16 = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        q_strip = builder.gep(q_arr.data, [builder.mul(s, builder.mul(blocks, ir.Constant(i64, block_bytes)))])
        ts = [builder.add(t, ir.Constant(i64, i)) for i in range(rows)]
        x_rows = [builder.gep(xq_arr.data, [builder.mul(u, builder.mul(blocks, ir.Constant(i64, 32)))]) for u in ts]
        factor_rows = builder.extract_value(qs_arr.shape, 1)  # blocks, or super-blocks with SUB_SCALES
        qs_strip = builder.gep(qs_arr.data, [builder.mul(s, builder.mul(factor_rows, ir.Constant(i64, factors_per_block)))])
        xs_rows = [builder.gep(xs_arr.data, [builder.mul(u, blocks)]) for u in ts]
        xsum_rows = [builder.gep(xsum_arr.data, [builder.mul(u, blocks)]) for u in ts]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(floats16, None)) for _ in ts]

        def load_floats(at):
            return builder.load(builder.bitcast(at, floats16.as_pointer()), align=4)

        def block_factors(lines, factors, k):
            """Factors k..k + 15 of the block: as stored, or SUB_SCALES's bytes times their float32."""
            stored = load_floats(builder.gep(factors, [ir.Constant(i64, k)]))
            if not weights.SUB_SCALES:
                return stored
            ints = builder.gep(lines, [ir.Constant(i64, block_bytes - factors_per_block + k)])
            ints = builder.load(builder.bitcast(ints, ir.VectorType(ir.IntType(8), 16).as_pointer()), align=1)
            return builder.fmul(stored, (builder.sitofp if weights.SIGNED else builder.uitofp)(ints, floats16))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            lines = builder.gep(q_strip, [builder.mul(b, ir.Constant(i64, block_bytes))])
            line_weights = _line_weights(builder, lines, weights)
            factor_row = builder.udiv(b, ir.Constant(i64, SUPER_BLOCKS)) if weights.SUB_SCALES else b
            factors = builder.gep(qs_strip, [builder.mul(factor_row, ir.Constant(i64, factors_per_block))])
            group_scales = [block_factors(lines, factors, STRIP * group) for group in range(scales)]
            minima = block_factors(lines, factors, STRIP * scales) if weights.MINIMA else None
            for x_row, xs_row, xsum_row, acc in zip(x_rows, xs_rows, xsum_rows, accs):
                pairs = builder.bitcast(builder.gep(x_row, [builder.mul(b, ir.Constant(i64, 32))]), i32.as_pointer())
                x_scale = splat(builder, builder.load(builder.gep(xs_row, [b])), floats16)
                block = None
                for group in range(scales):  # the lines each scale covers
                    ints = ir.Constant(ints16, None)
                    for r in range(group * STRIP // scales, (group + 1) * STRIP // scales):
                        pair = splat(builder, builder.load(builder.gep(pairs, [ir.Constant(i64, r)]), align=2), ints16)
                        ints = builder.add(ints, _pair_sums(builder, line_weights[r], builder.bitcast(pair, shorts32)))
                    part = builder.fmul(builder.sitofp(ints, floats16), builder.fmul(group_scales[group], x_scale))
                    block = part if block is None else builder.fadd(block, part)
                if weights.MINIMA:
                    x_sum = splat(builder, builder.load(builder.gep(xsum_row, [b])), floats16)
                    block = builder.fadd(block, builder.fmul(minima, x_sum))
                builder.store(builder.fadd(builder.load(acc), block), acc)
        for u, acc in zip(ts, accs):
            dest = builder.gep(out_arr.data, [builder.add(builder.mul(u, width), builder.mul(s, ir.Constant(i64, 16)))])
            builder.store(builder.load(acc), builder.bitcast(dest, floats16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(q, s, xq, t, qs, xs, xsum, out, kind, tile), codegen


@njit("void(float32[:, ::1], int16[:, ::1], float32[:, ::1], float32[:, ::1])", fastmath=True, cache=True,
      nogil=True)
def _scale_to_int16(x, xq, xs, xsum):
    """Activations to int16 blocks of 32 with one scale each, rounded to nearest; and each
    block's sum as rounded (for the minima)."""
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


def compiled(kernel, signature: str, weights: type[Strips]):
    """kernel compiled for one scheme under its own name (numba's cache keys on the name): at
    import for Q8_0 and Q4_1, which pack.compress makes of any weight, and at first use for the
    schemes only a GGUF's tensors come in, so that a start compiles none its model lacks (numba's
    cache keeps both)."""
    kernel.__name__ = kernel.__qualname__ = f"{kernel.__name__}_{weights.kind}"
    return njit(signature if weights in (Q8_0Strips, Q4_1Strips) else None, parallel=True, cache=True,
                nogil=True)(kernel)


def _gemv_kernel(weights: type[Strips]):
    """The GEMV for one scheme (its kind a literal). No fastmath: numba sets its flags on every
    instruction of the module, the intrinsic's too, and reassociation there makes a block's float
    order the compiler's (Q4_K's factors computed in the kernel would then differ from the same
    factors stored)."""
    kind = weights.kind

    def strip_gemv(xq, xs, xsum, q, qs, out):  # rows two at a time, each pair's lines widened once
        tokens = xq.shape[0]
        for s in prange(q.shape[0]):
            for t in range(0, tokens - 1, 2):
                _strip_dot(q, s, xq, t, qs, xs, xsum, out, kind, 2)
            if tokens % 2:
                _strip_dot(q, s, xq, tokens - 1, qs, xs, xsum, out, kind, 1)
    return compiled(strip_gemv, "void(int16[:, ::1], float32[:, ::1], float32[:, ::1], int8[:, :, ::1],"
                    " float32[:, :, ::1], float32[:, ::1])", weights)


_GEMV = {weights: _gemv_kernel(weights) for weights in SCHEMES.values()}


def gemv(x: np.ndarray, w: Strips) -> np.ndarray:
    """x @ w.T over every strip (rows past w's last included), for C-ordered float32 x."""
    tokens, in_dim = x.shape
    out = np.empty((tokens, w.q.shape[0] * STRIP), dtype=np.float32)
    xq = np.empty(x.shape, dtype=np.int16)
    xs = np.empty((tokens, in_dim // BLOCK), dtype=np.float32)
    xsum = np.empty((tokens, in_dim // BLOCK), dtype=np.float32)
    _scale_to_int16(x, xq, xs, xsum)
    _GEMV[type(w)](xq, xs, xsum, w.q, w.factors, out)
    return out
