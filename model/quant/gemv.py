"""x @ w.T for packed weights, a strip at a time, in integers: the activations rounded per block
of 32 to int8 (as llama.cpp's quantized paths do) or int16 (closer to float32; the backend
chooses, model/backend.py), each weight an unsigned byte, products summed into exact int32
sums. The same kernel serves every row count and every CPU, so a row's output has the same bits
alone, in any batch, and on any machine.

A decode step at batch 1 reads every weight once, so it is bound by memory bandwidth: a quarter
of the bytes makes it faster. Per block, 8 lines of 64 weights times a broadcast quad of
activations give the 16 rows' int32 sums in 16 lanes, less ZERO times the activations' sum,
scaled into 16 float lanes by the weight and activation scales. Batches and prefill are
compute-bound: with VNNI a line times an int8 quad is one vpdpbusd (64 products; two with
AVX-VNNI's 256-bit registers), and the rows go four at a time, a block's lines unpacked once for
all four, each row's arithmetic still the sequence it has alone. On AVX2 and AVX-512BW without
VNNI the int8 products go through pmaddubsw and pmaddwd, and on ARM through sdot where the CPU
has the dot product; otherwise (int16 activations, other CPUs) the same sums are plain LLVM
vector IR (bytes widened to int16, pair sums as pmaddwd, the pairs added once per scale), which
LLVM lowers at the width the target has (vpdpwssd with VNNI) and other back ends into their own
multiply-adds. Integer
sums are exact every way, so all give the same bits. Each scheme's kernels are generated from
its constants (strips.py: nibbles, high bits, ZERO, SIGNED_VALUES, SCALES, MINIMA, SUB_SCALES,
SIGNED, LEVELS, EXPONENTS), compiled under its kind."""

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from model.ops.llvm_ir import array, splat
from model.quant import tiles
from model.quant.cpu import AMX
from model.quant.int_sums import INTS16, group_sum
from model.quant.levels import levels, powers_of_two
from model.quant.strips import (BLOCK, LINE_BYTES, LINES, NIBBLE_BYTES, QUAD, SCHEMES, STRIP, SUPER_BLOCKS,
                                Q4_1Strips, Q8_0Strips, Strips)

BYTES64 = ir.VectorType(ir.IntType(8), LINE_BYTES)


def _line_weights(builder, lines, weights: type[Strips]) -> list[ir.Value]:
    """The 8 lines of a (strip, block) at lines (i8*) as 64 unsigned bytes each: Q8_0's as
    stored; else line l the low (l even) or high nibbles of 64-byte group l // 2, and above them
    its HIGH_BITS bits, shifted out of its high group's bytes, or with LEVELS the levels its
    nibbles' codes stand for (strips.py)."""
    i64 = ir.IntType(64)

    def load(at):
        return builder.load(builder.bitcast(builder.gep(lines, [ir.Constant(i64, at)]), BYTES64.as_pointer()), align=1)

    def bytes_of(value):
        return ir.Constant(BYTES64, [value] * LINE_BYTES)

    if not weights.NIBBLES:
        return [load(LINE_BYTES * line) for line in range(LINES)]
    pairs = [load(LINE_BYTES * p) for p in range(LINES // 2)]
    high_bits = weights.HIGH_BITS
    groups = [load(NIBBLE_BYTES + LINE_BYTES * g) for g in range(high_bits)]
    out = []
    for line in range(LINES):
        value = (builder.and_(pairs[line // 2], bytes_of(15)) if line % 2 == 0
                 else builder.lshr(pairs[line // 2], bytes_of(4)))
        if high_bits:
            shared = 8 // high_bits  # lines whose high bits share a byte
            shift = high_bits * (line % shared)
            high = builder.lshr(groups[line // shared], bytes_of(shift)) if shift else groups[line // shared]
            if shift + high_bits < 8:
                high = builder.and_(high, bytes_of((1 << high_bits) - 1))
            value = builder.or_(value, builder.shl(high, bytes_of(4)))
        out.append(levels(builder, value, weights.LEVELS) if weights.LEVELS else value)
    return out


def _widened(builder, bits: ir.Value) -> ir.Value:
    """float16 bits (n x i16) as the float32s they stand for, exactly, in integer IR that every
    target lowers (LLVM's own half to float is a library call numba cannot link without F16C):
    a normal half's exponent rebased, a subnormal's mantissa times 2^-24 (no float32 subnormal
    is made, so a CPU flushing them cannot change it). Infinities and NaNs, which no finite
    weight has, are not kept."""
    n = bits.type.count
    ints, floats = ir.VectorType(ir.IntType(32), n), ir.VectorType(ir.FloatType(), n)

    def each(value):
        return ir.Constant(ints, [value] * n)

    wide = builder.zext(bits, ints)
    magnitude = builder.and_(wide, each(0x7FFF))
    normal = builder.bitcast(builder.add(builder.shl(magnitude, each(13)), each((127 - 15) << 23)), floats)
    subnormal = builder.fmul(builder.sitofp(magnitude, floats), ir.Constant(floats, [2.0 ** -24] * n))
    value = builder.select(builder.icmp_unsigned("<", magnitude, each(0x400)), subnormal, normal)
    sign = builder.shl(builder.and_(wide, each(0x8000)), each(16))
    return builder.bitcast(builder.or_(builder.bitcast(value, ints), sign), floats)


def _tiled(weights: type[Strips]) -> bool:
    """Whether 16 int8 rows at a time go through AMX's tiles (tiles.py): where the CPU has them,
    for schemes with one scale a block."""
    return AMX and weights.SCALES == 1


@intrinsic(prefer_literal=True)
def _strip_dot(typingctx, q, s, lines, sums, xq, t, qs, xs, xsum, out, o, kind, tile):
    """out[t + i, 16o:16o+16] = strip s times activation row t + i for i < tile (1, 2, 4 or 16), for
    the scheme named kind (kind and tile literals): the block's lines unpacked and its weight
    factors read once for the tile's rows, each row's arithmetic the same sequence as alone (so
    the same bits). Per block and scale, the lines times broadcast quads of activations, less
    ZERO times the activations' sum (xsum, per 16), in int32 (int_sums.group_sum; for 16 int8
    rows with AMX, tiles.products: every block's into sums before the float work begins, the
    weights as _unpack_strip left them in lines); each sum scaled by the
    weight and activation scales into 16 float lanes, in line order; with MINIMA, each row's
    minimum times the block's activation sum (xs) added last, with two scales each half's
    minimum times its half's (xsum, scaled)."""
    if not isinstance(kind, types.StringLiteral) or not isinstance(tile, types.IntegerLiteral):
        return None
    weights, rows = SCHEMES[kind.literal_value], tile.literal_value
    block_bytes, factors_per_block, scales = weights.BLOCK_BYTES, weights.FACTORS, weights.SCALES
    amx = _tiled(weights) and rows == tiles.ROWS and xq.dtype.bitwidth == 8

    def codegen(context, builder, signature, args):
        q_arr, lines_arr, sums_arr, xq_arr, qs_arr, xs_arr, xsum_arr, out_arr = (
            array(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 4, 6, 7, 8, 9))
        s, t, o = args[1], args[5], args[10]
        i64 = ir.IntType(64)
        quad_type = ir.IntType(QUAD * xq.dtype.bitwidth)  # a quad of int8 or int16 activations
        blocks = builder.extract_value(q_arr.shape, 1)
        width = builder.extract_value(out_arr.shape, 1)
        floats16 = ir.VectorType(ir.FloatType(), 16)
        q_strip = builder.gep(q_arr.data, [builder.mul(s, builder.mul(blocks, ir.Constant(i64, block_bytes)))])
        ts = [builder.add(t, ir.Constant(i64, i)) for i in range(rows)]
        x_rows = [builder.gep(xq_arr.data, [builder.mul(u, builder.mul(blocks, ir.Constant(i64, BLOCK)))]) for u in ts]
        factor_rows = builder.extract_value(qs_arr.shape, 1)  # blocks, or super-blocks with SUB_SCALES
        qs_strip = builder.gep(qs_arr.data,
                               [builder.mul(s, builder.mul(factor_rows, ir.Constant(i64, factors_per_block)))])
        xs_rows = [builder.gep(xs_arr.data, [builder.mul(u, builder.mul(blocks, ir.Constant(i64, 2)))]) for u in ts]
        xsum_rows = [builder.gep(xsum_arr.data, [builder.mul(u, builder.mul(blocks, ir.Constant(i64, 2)))]) for u in ts]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(floats16, None)) for _ in ts]

        halves16 = ir.VectorType(ir.IntType(16), 16)

        def block_factors(lines, factors, k):
            """Factors k..k + 15 of the block: as stored, SUB_SCALES's bytes times them, or
            EXPONENTS's powers of two."""
            if weights.SUB_SCALES or weights.EXPONENTS:
                ints = builder.gep(lines, [ir.Constant(i64, block_bytes - factors_per_block + k)])
                ints = builder.load(builder.bitcast(ints, ir.VectorType(ir.IntType(8), 16).as_pointer()), align=1)
                if weights.EXPONENTS:
                    return powers_of_two(builder, ints)
            at = builder.bitcast(builder.gep(factors, [ir.Constant(i64, k)]), halves16.as_pointer())
            stored = _widened(builder, builder.load(at, align=2))
            if not weights.SUB_SCALES:
                return stored
            return builder.fmul(stored, (builder.sitofp if weights.SIGNED else builder.uitofp)(ints, floats16))

        if amx:
            sums = builder.bitcast(sums_arr.data, ir.IntType(8).as_pointer())
            tiles.products(builder, builder.bitcast(x_rows[0], ir.IntType(8).as_pointer()), blocks,
                           builder.bitcast(lines_arr.data, ir.IntType(8).as_pointer()), sums)
        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            lines = builder.gep(q_strip, [builder.mul(b, ir.Constant(i64, block_bytes))])
            line_weights = None if amx else _line_weights(builder, lines, weights)
            factor_row = builder.udiv(b, ir.Constant(i64, SUPER_BLOCKS)) if weights.SUB_SCALES else b
            factors = builder.gep(qs_strip, [builder.mul(factor_row, ir.Constant(i64, factors_per_block))])
            group_scales = [block_factors(lines, factors, STRIP * group) for group in range(scales)]
            minima = [block_factors(lines, factors, STRIP * (scales + group))
                      for group in range(scales)] if weights.MINIMA else None
            for row, (x_row, xs_row, xsum_row, acc) in enumerate(zip(x_rows, xs_rows, xsum_rows, accs)):
                quads = builder.bitcast(builder.gep(x_row, [builder.mul(b, ir.Constant(i64, BLOCK))]),
                                        quad_type.as_pointer())
                scale = builder.load(builder.gep(xs_row, [builder.mul(b, ir.Constant(i64, 2))]))
                x_scale = splat(builder, scale, floats16)
                halves = [builder.load(builder.gep(xsum_row, [builder.add(builder.mul(b, ir.Constant(i64, 2)),
                                                                          ir.Constant(i64, h))])) for h in range(2)]
                block = None
                for group in range(scales):  # the lines each scale covers
                    group_lines = range(group * LINES // scales, (group + 1) * LINES // scales)
                    x_sum = None
                    if weights.ZERO:
                        x_sum = halves[group] if scales == 2 else builder.add(halves[0], halves[1])
                    if amx:
                        ints = tiles.row_sums(builder, sums, b, row)
                        if x_sum is not None:
                            zero = builder.mul(x_sum, ir.Constant(ir.IntType(32), -weights.ZERO))
                            ints = builder.add(splat(builder, zero, INTS16), ints)
                    else:
                        ints = group_sum(builder, [line_weights[line] for line in group_lines],
                                          [builder.load(builder.gep(quads, [ir.Constant(i64, line)]), align=1)
                                           for line in group_lines], x_sum, weights)
                    part = builder.fmul(builder.sitofp(ints, floats16), builder.fmul(group_scales[group], x_scale))
                    block = part if block is None else builder.fadd(block, part)
                if weights.MINIMA and scales == 1:
                    at = builder.gep(xs_row, [builder.add(builder.mul(b, ir.Constant(i64, 2)), ir.Constant(i64, 1))])
                    scaled_sum = splat(builder, builder.load(at), floats16)
                    block = builder.fadd(block, builder.fmul(minima[0], scaled_sum))
                elif weights.MINIMA:  # a minimum per scale: each times its half's activation sum
                    for group, half in enumerate(halves):
                        scaled_sum = builder.fmul(builder.sitofp(splat(builder, half, INTS16), floats16), x_scale)
                        block = builder.fadd(block, builder.fmul(minima[group], scaled_sum))
                builder.store(builder.fadd(builder.load(acc), block), acc)
        for u, acc in zip(ts, accs):
            dest = builder.gep(out_arr.data, [builder.add(builder.mul(u, width), builder.mul(o, ir.Constant(i64, 16)))])
            builder.store(builder.load(acc), builder.bitcast(dest, floats16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(q, s, lines, sums, xq, t, qs, xs, xsum, out, o, kind, tile), codegen


@intrinsic(prefer_literal=True)
def _unpack_strip(typingctx, q, s, lines, kind):
    """lines[512 b:512 b + 512] = the 8 lines of strip s's block b as 64 unsigned bytes each
    (_line_weights), for every block: a strip unpacked once for all the tile products of its
    rows (a tile read straight after the stores that made it waits for them)."""
    if not isinstance(kind, types.StringLiteral):
        return None
    weights = SCHEMES[kind.literal_value]

    def codegen(context, builder, signature, args):
        q_arr, lines_arr = (array(context, builder, signature.args[i], args[i]) for i in (0, 2))
        i64 = ir.IntType(64)
        blocks = builder.extract_value(q_arr.shape, 1)
        block_bytes = ir.Constant(i64, weights.BLOCK_BYTES)
        q_strip = builder.gep(q_arr.data, [builder.mul(args[1], builder.mul(blocks, block_bytes))])
        with cgutils.for_range(builder, blocks) as loop:
            lines = _line_weights(builder, builder.gep(q_strip, [builder.mul(loop.index, block_bytes)]), weights)
            first = builder.mul(loop.index, ir.Constant(i64, LINES * LINE_BYTES))
            for line, value in enumerate(lines):
                at = builder.gep(lines_arr.data, [builder.add(first, ir.Constant(i64, line * LINE_BYTES))])
                builder.store(value, builder.bitcast(at, BYTES64.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(q, s, lines, kind), codegen


@njit(["void(float32[:, ::1], int8[:, ::1], float32[:, ::1], int32[:, ::1])",
       "void(float32[:, ::1], int16[:, ::1], float32[:, ::1], int32[:, ::1])"],
      fastmath={"nnan", "ninf", "nsz", "reassoc"}, cache=True, nogil=True)
def _scale_to_ints(x, xq, xs, xsum):
    """Activations to blocks of 32 integers (int8: -127..127; int16: -32767..32767) with one
    scale each (xs[t, 2b]), rounded to nearest; the sum of each 16 as rounded (xsum, for ZERO);
    and the block's sum times its scale (xs[t, 2b + 1], what the minima multiply, made once
    here rather than once a strip). Exact reciprocals (no arcp), so that NumPy rounds as this
    does (tests/reference.py)."""
    tokens, in_dim = x.shape
    top_level = np.float32(127.0) if xq.itemsize == 1 else np.float32(32767.0)
    for t in range(tokens):
        for b in range(in_dim // 32):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[t, b * 32 + j]))
            s = top / top_level
            xs[t, 2 * b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for h in range(2):
                total = 0
                for j in range(b * 32 + 16 * h, b * 32 + 16 * h + 16):
                    v = np.rint(x[t, j] * inv)
                    xq[t, j] = v
                    total += np.int32(v)
                xsum[t, 2 * b + h] = total
            xs[t, 2 * b + 1] = np.float32(xsum[t, 2 * b] + xsum[t, 2 * b + 1]) * s


def compiled(kernel, signature: list[str] | None, weights: type[Strips]):
    """kernel compiled for one scheme under its own name (numba's cache keys on the name): at
    import for Q8_0 and Q4_1 given a signature, which pack.compress makes of any weight, and at
    first use for the schemes only a GGUF's tensors come in (and for kernels only some models
    use: signature None), so that a start compiles none its model lacks (numba's cache keeps both)."""
    kernel.__name__ = kernel.__qualname__ = f"{kernel.__name__}_{weights.kind}"
    return njit(signature if weights in (Q8_0Strips, Q4_1Strips) else None, parallel=True, cache=True,
                nogil=True)(kernel)


@njit(nogil=True)
def _strip_rows(q, s, xq, t, end, qs, xs, xsum, out, o, kind, tiled):
    """Activation rows t to end times strip s, into out's strip o, for the scheme named kind: 16
    at a time through AMX's tiles where tiled is 16 (_tiled: the strip's lines unpacked once for
    them all), then 4, 2, 1 at a time; each row's arithmetic the same whatever its tile."""
    literally(kind)
    literally(tiled)
    rows = end - t - (end - t) % 16 if tiled == 16 and xq.itemsize == 1 else 0
    if rows:  # (allocated only here: a decode step's rows never pay for them)
        lines = np.empty(q.shape[1] * LINES * LINE_BYTES, dtype=np.int8)
        sums = np.empty(q.shape[1] * tiles.SUMS_BYTES, dtype=np.int8)
        _unpack_strip(q, s, lines, kind)
        for first in range(t, t + rows, 16):
            _strip_dot(q, s, lines, sums, xq, first, qs, xs, xsum, out, o, kind, tiled)
        t += rows
    while t + 4 <= end:  # (q stands in for the tiles' buffers, which these rows do not read)
        _strip_dot(q, s, q, q, xq, t, qs, xs, xsum, out, o, kind, 4)
        t += 4
    if end - t >= 2:
        _strip_dot(q, s, q, q, xq, t, qs, xs, xsum, out, o, kind, 2)
        t += 2
    if end - t:
        _strip_dot(q, s, q, q, xq, t, qs, xs, xsum, out, o, kind, 1)


def _gemv_kernel(weights: type[Strips]):
    """The GEMV for one scheme (its kind a literal). No fastmath: numba sets its flags on every
    instruction of the module, the intrinsic's too, and reassociation there makes a block's float
    order the compiler's (Q4_K's factors computed in the kernel would then differ from the same
    factors stored)."""
    kind, tiled = weights.kind, 16 if _tiled(weights) else 4  # 4: no tile loop to compile

    def strip_gemv(xq, xs, xsum, q, qs, out, first):  # strip s to out's strip first + s
        for s in prange(q.shape[0]):
            _strip_rows(q, s, xq, 0, xq.shape[0], qs, xs, xsum, out, first + s, kind, tiled)
    return compiled(strip_gemv, [f"void({ints}[:, ::1], float32[:, ::1], int32[:, ::1], int8[:, :, ::1],"
                                 " uint16[:, :, ::1], float32[:, ::1], int64)" for ints in ("int8", "int16")],
                    weights)


def _grouped_kernel(weights: type[Strips]):
    """The GEMV of a mixture's experts: strip s of expert e (its rows stacked, `strips` strips
    each) times expert e's rows of xq only (starts), every (active expert, strip) one parallel
    item, written to out's strip s - e x strips. Each row's arithmetic is the plain GEMV's."""
    kind, tiled = weights.kind, 16 if _tiled(weights) else 4

    def grouped_gemv(xq, xs, xsum, q, qs, starts, active, strips, out):
        for item in prange(active.shape[0] * strips):
            e = active[item // strips]
            o = item % strips
            _strip_rows(q, e * strips + o, xq, starts[e], starts[e + 1], qs, xs, xsum, out, o, kind, tiled)
    return compiled(grouped_gemv, None, weights)


_GEMV = {weights: _gemv_kernel(weights) for weights in SCHEMES.values()}
_GROUPED = {weights: _grouped_kernel(weights) for weights in SCHEMES.values()}


def _integers(x: np.ndarray, activations):
    """x's blocks of 32 rounded to activations: (values, scales and scaled sums, sums of 16)."""
    tokens, in_dim = x.shape
    xq = np.empty(x.shape, dtype=activations)
    xs = np.empty((tokens, 2 * in_dim // BLOCK), dtype=np.float32)
    xsum = np.empty((tokens, 2 * in_dim // BLOCK), dtype=np.int32)
    _scale_to_ints(x, xq, xs, xsum)
    return xq, xs, xsum


def gemv(x: np.ndarray, parts: tuple[Strips, ...], activations=np.int8) -> np.ndarray:
    """x @ w.T for w the parts stacked along their rows (a Q4_K_M file's Q4_K q and k beside its
    Q6_K v), over every strip of each (rows past a part's last included), for C-ordered float32
    x, its blocks rounded to activations (np.int8 or np.int16) once for all parts."""
    xq, xs, xsum = _integers(x, activations)
    out = np.empty((x.shape[0], sum(w.q.shape[0] for w in parts) * STRIP), dtype=np.float32)
    first = 0
    for w in parts:
        _GEMV[type(w)](xq, xs, xsum, w.q, w.factors.view(np.uint16), out, first)
        first += w.q.shape[0]
    return out


def grouped_gemv(x: np.ndarray, w: Strips, experts: int, starts: np.ndarray, active: np.ndarray,
                 activations=np.int8) -> np.ndarray:
    """Each expert's rows of x (starts, rows sorted by expert) times that expert's rows of w (the
    experts' weights stacked, a whole number of strips each), for the active experts, in one call."""
    strips = w.q.shape[0] // experts
    out = np.empty((x.shape[0], strips * STRIP), dtype=np.float32)
    _GROUPED[type(w)](*_integers(x, activations), w.q, w.factors.view(np.uint16), starts, active, strips,
                            out)
    return out
