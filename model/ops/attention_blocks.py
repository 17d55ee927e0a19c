"""The attention kernel's steps on one K/V block, as numba intrinsics in LLVM IR
(model/ops/numba_attention.py runs them): scoring a tile's queries against sixteen keys a
vector, folding a query's scores into its online softmax, adding V rows into its output,
widening float16 bits (or q8_0 values times their scales) once, and prefetching the next block.

Every step keeps one rule: a query's arithmetic is the same whatever else a call computes beside
it (which queries share a pass, which lanes are masked), so a token's output never depends on
its tile, its chunk or its company. Each score and each output element is one chain of fused
multiply-adds in a fixed order (llvm.fma, never contracted or reassociated), and reductions
across lanes pair halves in a fixed order.
"""

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from model.ops.llvm_ir import byte_address, element, splat
from model.ops.numba_kernels import FASTMATH, LN2_HIGH, LN2_LOW, LOG2E
from model.ops.protocol import SCALE_BYTES

LANES = 16  # keys scored at once, and output dimensions added at once


@intrinsic
def prefetch(typingctx, array, offset):
    """Ask for the cache line holding flat element offset of a C-contiguous array (no fault if
    it is out of range): a decode step walks blocks scattered through memory, which the
    hardware prefetcher cannot guess."""
    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        address = byte_address(context, builder, signature.args[0], args[0], args[1])
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return nbtypes.void(array, offset), codegen


def _load(builder, address, dtype, width: int) -> ir.Value:
    """width elements from address as floats (one float for width 1): float32 as they are,
    float16 bits widened, int8 converted (q8_0 blocks are scaled by widen_keys and widen_values;
    this only lets the kernel compile for them)."""
    f32 = ir.FloatType()
    if dtype == nbtypes.float32:
        kind = ir.VectorType(f32, width) if width > 1 else f32
        return builder.load(builder.bitcast(address, kind.as_pointer()), align=4)
    if dtype == nbtypes.int8:
        byte = ir.VectorType(ir.IntType(8), width) if width > 1 else ir.IntType(8)
        return builder.sitofp(builder.load(builder.bitcast(address, byte.as_pointer()), align=1),
                              ir.VectorType(f32, width) if width > 1 else f32)
    half = ir.VectorType(ir.HalfType(), width) if width > 1 else ir.HalfType()
    return builder.fpext(builder.load(builder.bitcast(address, half.as_pointer()), align=2),
                         ir.VectorType(f32, width) if width > 1 else f32)


def _fma(builder, a, b, c) -> ir.Value:
    """a * b + c rounded once, lane by lane (llvmlite's builder.fma takes scalars only)."""
    kind = a.type
    name = f"llvm.fma.v{kind.count}f32" if isinstance(kind, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(kind, [kind] * 3), name)
    return builder.call(fn, [a, b, c])


def _broadcast(builder, value, width: int) -> ir.Value:
    return splat(builder, value, ir.VectorType(ir.FloatType(), width)) if width > 1 else value


def _pointers(context, builder, signature, args, *which):
    zero = ir.Constant(ir.IntType(64), 0)
    return [element(context, builder, signature.args[i], args[i], zero) for i in which]


def _in_passes(builder, start, stop, body):
    """body(count, row) over rows start .. stop - 1: passes of eight rows while they fit, then of
    four, then single rows. Eight independent chains of multiply-adds keep both FMA units busy."""
    i64 = ir.IntType(64)
    for count in (8, 4, 1):
        size = ir.Constant(i64, count)
        end = builder.add(start, builder.mul(builder.sdiv(builder.sub(stop, start), size), size))
        with cgutils.for_range_slice(builder, start, end, size) as (row, _):
            body(count, row)
        start = end


def _float_kind(width: int):
    return ir.VectorType(ir.FloatType(), width) if width > 1 else ir.FloatType()


@intrinsic
def block_scores(typingctx, qs, rows, dim, keys, base, block_size, s):
    """s[r * block_size + i] = qs[r * dim:(r + 1) * dim] . key i, for r < rows and every key of
    the head-dim-major K block at flat offset base of keys. Each score is one chain of fused
    multiply-adds over the dimensions in order: sixteen keys a vector, the queries of a pass
    sharing each load, keys past the last multiple of sixteen a lane at a time; which queries
    share a pass changes no bits of any."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        q_ptr, s_ptr = _pointers(context, builder, signature, args, 0, 6)
        k_ptr = element(context, builder, signature.args[3], args[3], args[4])
        rows, dim, block_size = args[1], args[2], args[5]

        def scores(width: int, count: int, key: ir.Value, row: ir.Value):
            """count queries from row against width keys from key."""
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_float_kind(width), None)) for _ in range(count)]
            with cgutils.for_range(builder, dim) as d:
                k = _load(builder, builder.gep(k_ptr, [builder.add(builder.mul(d.index, block_size), key)]),
                          signature.args[3].dtype, width)
                for j, acc in enumerate(accs):
                    at = builder.add(builder.mul(builder.add(row, ir.Constant(i64, j)), dim), d.index)
                    q = _broadcast(builder, builder.load(builder.gep(q_ptr, [at])), width)
                    builder.store(_fma(builder, q, k, builder.load(acc)), acc)
            for j, acc in enumerate(accs):
                at = builder.add(builder.mul(builder.add(row, ir.Constant(i64, j)), block_size), key)
                builder.store(builder.load(acc), builder.bitcast(builder.gep(s_ptr, [at]), acc.type), align=4)

        zero, one, lanes = ir.Constant(i64, 0), ir.Constant(i64, 1), ir.Constant(i64, LANES)
        whole = builder.mul(builder.sdiv(block_size, lanes), lanes)  # keys in whole vectors
        with cgutils.for_range_slice(builder, zero, whole, lanes) as (key, _):
            _in_passes(builder, zero, rows, lambda count, row: scores(LANES, count, key, row))
        with cgutils.for_range_slice(builder, whole, block_size, one) as (key, _):
            _in_passes(builder, zero, rows, lambda count, row: scores(1, count, key, row))
        return context.get_dummy_value()
    return nbtypes.void(qs, rows, dim, keys, base, block_size, s), codegen


@intrinsic
def widen(typingctx, source, at, count, out):
    """out[:count] = source[at:at + count] as float32 (float16 bits widened), sixteen a vector:
    a block read by several passes is converted once (count a multiple of sixteen)."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        src = element(context, builder, signature.args[0], args[0], args[1])
        dst, = _pointers(context, builder, signature, args, 3)
        step = ir.Constant(i64, LANES)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), args[2], step) as (i, _):
            values = _load(builder, builder.gep(src, [i]), signature.args[0].dtype, LANES)
            builder.store(values, builder.bitcast(builder.gep(dst, [i]), values.type.as_pointer()), align=4)
        return context.get_dummy_value()
    return nbtypes.void(source, at, count, out), codegen


@njit(inline="always", fastmath=FASTMATH)
def widen_keys(cache, at, scales, block_size, dim, out):
    """A q8_0 K block at flat byte offset at (head-dim-major int8 values, then each key's float32
    scale: model/kv_cache.py) as float32, out[d * block_size + i] = value times its key's scale;
    scales is the same cache seen as float32. One product per element, so a key reads the same
    whichever query tile widens it."""
    flat, first = cache.reshape(cache.size), (at + dim * block_size) // 4
    for d in range(dim):
        for i in range(block_size):
            out[d * block_size + i] = np.float32(flat[at + d * block_size + i]) * scales[first + i]


@njit(inline="always", fastmath=FASTMATH)
def widen_values(cache, at, scales, block_size, dim, out):
    """A q8_0 V block at flat byte offset at (rows of dim int8 values, each followed by its
    float32 scale) as float32 rows dim apart."""
    flat, width = cache.reshape(cache.size), dim + SCALE_BYTES
    for i in range(block_size):
        scale = scales[(at + i * width + dim) // 4]
        for d in range(dim):
            out[i * dim + d] = np.float32(flat[at + i * width + d]) * scale


@intrinsic
def accumulate(typingctx, acc, first, rows, corrections, p, stride, lo, keys, values, base, dim):
    """For each query r of first .. first + rows - 1: acc[r * dim:(r + 1) * dim] times
    corrections[r], plus p[r * stride + lo + i] times V row lo + i for each i < keys, the V rows
    at flat offset base of values, dim apart. Each output element is one chain of fused
    multiply-adds in key order, sixteen elements a vector (the rest a lane at a time), the
    queries of a pass sharing each load of V; which queries share a pass changes no bits."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        out_ptr, c_ptr, p_ptr = _pointers(context, builder, signature, args, 0, 3, 4)
        first, rows, stride, lo, keys = args[1], args[2], args[5], args[6], args[7]
        v_ptr = element(context, builder, signature.args[8], args[8], args[9])
        dim = args[10]

        def update(width: int, count: int, chunk: ir.Value, row: ir.Value):
            """count queries from row, width elements from chunk."""
            kind = _float_kind(width)
            rows_at = [builder.add(row, ir.Constant(i64, j)) for j in range(count)]
            dests = [builder.bitcast(builder.gep(out_ptr, [builder.add(builder.mul(r, dim), chunk)]), kind.as_pointer())
                     for r in rows_at]
            totals = [cgutils.alloca_once_value(builder, builder.fmul(
                builder.load(dest, align=4), _broadcast(builder, builder.load(builder.gep(c_ptr, [r])), width)))
                for dest, r in zip(dests, rows_at)]
            with cgutils.for_range(builder, keys) as i:
                key = builder.add(lo, i.index)
                v = _load(builder, builder.gep(v_ptr, [builder.add(builder.mul(key, dim), chunk)]),
                          signature.args[8].dtype, width)
                for r, total in zip(rows_at, totals):
                    weight = builder.load(builder.gep(p_ptr, [builder.add(builder.mul(r, stride), key)]))
                    builder.store(_fma(builder, _broadcast(builder, weight, width), v, builder.load(total)), total)
            for dest, total in zip(dests, totals):
                builder.store(builder.load(total), dest, align=4)

        zero, one, lanes = ir.Constant(i64, 0), ir.Constant(i64, 1), ir.Constant(i64, LANES)
        last = builder.add(first, rows)
        whole = builder.mul(builder.sdiv(dim, lanes), lanes)
        with cgutils.for_range_slice(builder, zero, whole, lanes) as (chunk, _):
            _in_passes(builder, first, last, lambda count, row: update(LANES, count, chunk, row))
        with cgutils.for_range_slice(builder, whole, dim, one) as (chunk, _):
            _in_passes(builder, first, last, lambda count, row: update(1, count, chunk, row))
        return context.get_dummy_value()
    return nbtypes.void(acc, first, rows, corrections, p, stride, lo, keys, values, base, dim), codegen


def _exp(builder, x) -> ir.Value:
    """exp(x), lane by lane (x a float or a vector of them), as exp_shifted computes it
    (model/ops/numba_kernels.py): inputs clamped to [-87, 88], Cody-Waite reduction, a degree-6
    polynomial, and 2^n through the exponent bits."""
    kind = x.type
    lanes = kind.count if isinstance(kind, ir.VectorType) else 0
    ints = ir.VectorType(ir.IntType(32), lanes) if lanes else ir.IntType(32)
    const = (lambda v: _broadcast(builder, ir.Constant(ir.FloatType(), float(v)), lanes or 1))
    suffix = f"v{lanes}f32" if lanes else "f32"

    def call(name, *args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(kind, [kind] * len(args)),
                                            f"llvm.{name}.{suffix}")
        return builder.call(fn, list(args))
    v = call("minnum", call("maxnum", x, const(-87.0)), const(88.0))
    n = call("floor", _fma(builder, v, const(LOG2E), const(0.5)))
    r = builder.fsub(builder.fsub(v, builder.fmul(n, const(LN2_HIGH))), builder.fmul(n, const(LN2_LOW)))
    p = const(1.0 / 720)
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = _fma(builder, p, r, const(c))
    bias = ir.Constant(ints, [127] * lanes) if lanes else ir.Constant(ints, 127)
    shift = ir.Constant(ints, [23] * lanes) if lanes else ir.Constant(ints, 23)
    power = builder.bitcast(builder.shl(builder.add(builder.fptosi(n, ints), bias), shift), kind)
    return builder.fmul(p, power)


def _across(builder, vector, name: str) -> ir.Value:
    """One float from a vector's lanes by llvm.NAME (maxnum, or fadd's add), halves paired in a
    fixed order."""
    i32 = ir.IntType(32)
    width = vector.type.count
    while width > 1:
        width //= 2
        halves = [builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(i32, width),
                                                                    list(range(at, at + width))))
                  for at in (0, width)]
        if name == "add":
            vector = builder.fadd(*halves)
        else:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(halves[0].type, [halves[0].type] * 2),
                                                f"llvm.{name}.v{width}f32")
            vector = builder.call(fn, halves)
    return builder.extract_element(vector, ir.Constant(i32, 0))


@intrinsic
def fold(typingctx, s, at, block_size, lo, hi, m, total, corrections, r):
    """Query r's scores of one block, s[at + lo:at + hi], into its online softmax: m[r] the
    running max, total[r] the running sum, corrections[r] what its output must be scaled by
    first (exp of the old max less the new); the scores become their exponentials, every other
    float of s as it was. Sixteen lanes a vector, masked, so any lo and hi give a query the same
    bits; s must hold sixteen floats past at + block_size."""
    def codegen(context, builder, signature, args):
        i64, f32 = ir.IntType(64), ir.FloatType()
        vec, lanes = ir.VectorType(f32, LANES), ir.VectorType(i64, LANES)
        s_ptr = element(context, builder, signature.args[0], args[0], args[1])
        block_size, lo, hi, r = args[2], args[3], args[4], args[8]
        m_ptr, total_ptr, c_ptr = (element(context, builder, signature.args[i], args[i], r) for i in (5, 6, 7))
        first, step = ir.Constant(i64, 0), ir.Constant(i64, LANES)
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec]), "llvm.maxnum.v16f32")

        def chunks(body):
            with cgutils.for_range_slice(builder, first, block_size, step) as (key, _):
                index = builder.add(ir.Constant(lanes, list(range(LANES))), splat(builder, key, lanes))
                valid = builder.and_(builder.icmp_signed(">=", index, splat(builder, lo, lanes)),
                                     builder.icmp_signed("<", index, splat(builder, hi, lanes)))
                address = builder.bitcast(builder.gep(s_ptr, [key]), vec.as_pointer())
                body(address, builder.load(address, align=4), valid)

        low = _broadcast(builder, ir.Constant(f32, -3e38), LANES)
        best = cgutils.alloca_once_value(builder, low)
        chunks(lambda address, x, valid: builder.store(
            builder.select(valid, builder.call(maxnum, [builder.load(best), x]), builder.load(best)), best))
        old = builder.load(m_ptr)
        top = builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32]),
                                                          "llvm.maxnum.f32"), [old, _across(builder, builder.load(best), "maxnum")])
        correction = cgutils.alloca_once_value(builder, ir.Constant(f32, 1.0))  # the max rarely moves
        with builder.if_then(builder.fcmp_ordered(">", top, old), likely=False):
            builder.store(_exp(builder, builder.fsub(old, top)), correction)
        correction = builder.load(correction)
        sums = cgutils.alloca_once_value(builder, ir.Constant(vec, None))

        def exponentials(address, x, valid):
            p = _exp(builder, builder.fsub(x, splat(builder, top, vec)))
            builder.store(builder.select(valid, p, x), address, align=4)  # other lanes may be other queries'
            builder.store(builder.fadd(builder.load(sums), builder.select(valid, p, ir.Constant(vec, None))), sums)
        chunks(exponentials)
        builder.store(top, m_ptr)
        builder.store(correction, c_ptr)
        builder.store(builder.fadd(builder.fmul(builder.load(total_ptr), correction),
                                   _across(builder, builder.load(sums), "add")), total_ptr)
        return context.get_dummy_value()
    return nbtypes.void(s, at, block_size, lo, hi, m, total, corrections, r), codegen
