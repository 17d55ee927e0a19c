"""Paged attention in numba, one kernel for every query token: a decode row's, and each of a
prefill chunk's, which reads the K/V of the positions up to its own as a decode row there would.
The LLVM intrinsics that read K/V rows live here too.

Each token reads K/V in place through its row's block table, one block at a time, with an
online softmax; the query heads of a KV head share each K/V load; (token, KV head) pairs run in
parallel, and each prefetches its next block. A token's arithmetic depends only on its own query,
context and K/V, so its output is the same bits whatever shares the step, however its prompt was
chunked, and whether it came as a decode row or in a prefill chunk (tests/test_batch_invariance.py).
Causal tiles of OpenBLAS GEMMs, which prefill chunks took before, depend on the tile's shape.
Per layer at SmolLM2-135M's shapes on a loaded 2-core EPYC, chunks of 256 and 512 tokens up to
position 512 took 3-18 ms here against the tiles' 16-350 ms (their OpenBLAS threads meet
numba's), but 256 tokens at position 1792 took 30 ms against 20: long prompts pay. K/V rows go
through two LLVM intrinsics that read float32 or widen float16 bits eight values at a time (the
q8_0 ops keep K/V in float16 where the target has F16C, see model/ops/numba_kernels.QUANTIZED_KV).
"""

import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from model.ops.llvm_ir import byte_address, element, splat
from model.ops.numba_kernels import F2, F3, F4, H4, I1, I2, exp_shifted, kernel


class AttentionPlan:
    """A step's attention, planned once for every layer: for each query token on the step's axis,
    its context (the positions up to and including its own) and its row's block table."""

    def __init__(self, query_lens, context_lens, block_tables, block_size):
        query_lens, context_lens = np.asarray(query_lens, dtype=np.int64), np.asarray(context_lens, dtype=np.int64)
        rows = np.repeat(np.arange(len(query_lens)), query_lens)  # each token's row
        first = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)  # each row's first token
        self.context = context_lens[rows] - query_lens[rows] + 1 + np.arange(len(rows)) - first[rows]
        tables = np.zeros((len(query_lens), -(-int(context_lens.max(initial=0)) // block_size)), dtype=np.int64)
        for r, c in enumerate(context_lens):
            used = -(-int(c) // block_size)
            tables[r, :used] = block_tables[r][:used]
        self.tables = tables[rows]


@intrinsic
def _prefetch(typingctx, array, offset):
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


def _load8(builder, address, dtype) -> ir.Value:
    """Eight elements from address as <8 x float>: float32 as they are, float16 bits widened."""
    floats = ir.VectorType(ir.FloatType(), 8)
    if dtype == nbtypes.float32:
        return builder.load(builder.bitcast(address, floats.as_pointer()), align=4)
    halves = ir.VectorType(ir.HalfType(), 8)
    return builder.fpext(builder.load(builder.bitcast(address, halves.as_pointer()), align=2), floats)


def _eight_at_a_time(builder, dim):
    """A loop over dim // 8 chunks (head_dim is a multiple of 8: check_model says so); its
    index times 8."""
    i64 = ir.IntType(64)
    loop = cgutils.for_range(builder, builder.sdiv(dim, ir.Constant(i64, 8)))
    return loop, lambda index: builder.mul(index, ir.Constant(i64, 8))


@intrinsic
def _dot_row(typingctx, q, q_at, row, at, dim):
    """q[q_at:q_at + dim] . row[at:at + dim] (flat offsets), the row float32 or float16 bits."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        q_ptr = element(context, builder, signature.args[0], args[0], args[1])
        row_ptr = element(context, builder, signature.args[2], args[2], args[3])
        acc = cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(ir.FloatType(), 8), None))
        loop, offset = _eight_at_a_time(builder, args[4])
        with loop as chunk:
            a = _load8(builder, builder.gep(q_ptr, [offset(chunk.index)]), nbtypes.float32)
            b = _load8(builder, builder.gep(row_ptr, [offset(chunk.index)]), signature.args[2].dtype)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(a, b)), acc)
        total = builder.load(acc)
        for width in (4, 2, 1):  # halves added pairwise
            lanes = [ir.Constant(ir.VectorType(i32, width), list(range(start, start + width))) for start in (0, width)]
            total = builder.fadd(*(builder.shuffle_vector(total, total, mask) for mask in lanes))
        return builder.extract_element(total, ir.Constant(i32, 0))
    return nbtypes.float32(q, q_at, row, at, dim), codegen


@intrinsic
def _add_row(typingctx, acc, acc_at, p, row, at, dim):
    """acc[acc_at:acc_at + dim] += p * row[at:at + dim], the row float32 or float16 bits."""
    def codegen(context, builder, signature, args):
        floats = ir.VectorType(ir.FloatType(), 8)
        acc_ptr = element(context, builder, signature.args[0], args[0], args[1])
        row_ptr = element(context, builder, signature.args[3], args[3], args[4])
        weight = splat(builder, args[2], floats)
        loop, offset = _eight_at_a_time(builder, args[5])
        with loop as chunk:
            dest = builder.bitcast(builder.gep(acc_ptr, [offset(chunk.index)]), floats.as_pointer())
            b = _load8(builder, builder.gep(row_ptr, [offset(chunk.index)]), signature.args[3].dtype)
            builder.store(builder.fadd(builder.load(dest, align=4), builder.fmul(weight, b)), dest, align=4)
        return context.get_dummy_value()
    return nbtypes.void(acc, acc_at, p, row, at, dim), codegen


@kernel(f"void({F3}, {F4}, {F4}, {I1}, {I2}, float32, int64, float32, {F2})",
        f"void({F3}, {H4}, {H4}, {I1}, {I2}, float32, int64, float32, {F2})")
def _attention(q, cache_k, cache_v, context, tables, scale, window, softcap, out):
    """For each query token t: out[t] = softmax(q K^T * scale) V over its context[t]
    cached positions (the last `window` of them for a sliding window), block by block with a
    running max and sum per query head; scores soft-capped where softcap is not 0.
    K/V rows are float32 or float16 bits, read through _dot_row and _add_row."""
    tokens = context.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, cache_blocks, block_size = cache_k.shape[0], cache_k.shape[1], cache_k.shape[2]
    group = heads // kv_heads
    for job in prange(tokens * kv_heads):
        t, kh = job // kv_heads, job % kv_heads
        n = context[t]
        qs = np.empty(group * dim, dtype=np.float32)  # query head g at g * dim
        acc = np.zeros(group * dim, dtype=np.float32)
        m = np.full(group, -np.inf, dtype=np.float32)
        total = np.zeros(group, dtype=np.float32)
        s = np.empty((group, block_size), dtype=np.float32)
        powers = np.empty(block_size, dtype=np.int32)
        for g in range(group):
            for d in range(dim):
                qs[g * dim + d] = q[t, kh * group + g, d] * scale
        start = max(0, n - window) if window > 0 else 0  # the first position this token sees
        blocks = -(-n // block_size)
        for b in range(start // block_size, blocks):
            lo = max(0, start - b * block_size)  # keys of the block before the window
            keys = min(block_size, n - b * block_size) - lo
            first = ((kh * cache_blocks + tables[t, b]) * block_size + lo) * dim  # the first key's flat offset
            if b + 1 < blocks:  # the next block's K and V, while this one computes
                following = (kh * cache_blocks + tables[t, b + 1]) * block_size * dim
                for line in range(0, block_size * dim, 64 // cache_k.itemsize):
                    _prefetch(cache_k, following + line)
                    _prefetch(cache_v, following + line)
            for i in range(keys):
                for g in range(group):
                    s[g, i] = _dot_row(qs, g * dim, cache_k, first + i * dim, dim)
                    if softcap > 0:
                        s[g, i] = softcap * np.tanh(s[g, i] / softcap)
            for g in range(group):
                top = m[g]
                for i in range(keys):
                    top = max(top, s[g, i])
                correction = np.exp(m[g] - top)
                m[g] = top
                total[g] = total[g] * correction + exp_shifted(s[g], top, keys, powers)
                for d in range(dim):
                    acc[g * dim + d] *= correction
            for i in range(keys):
                for g in range(group):
                    _add_row(acc, g * dim, s[g, i], cache_v, first + i * dim, dim)
        for g in range(group):
            inv = np.float32(1.0) / total[g]
            for d in range(dim):
                out[t, (kh * group + g) * dim + d] = acc[g * dim + d] * inv


def paged_attention(q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray, plan: AttentionPlan,
                    scale: float, window: int = 0, softcap: float = 0.0) -> np.ndarray:
    tokens, heads, dim = q.shape
    out = np.empty((tokens, heads * dim), dtype=np.float32)
    if tokens:
        seen = np.minimum(plan.context, window) if window else plan.context
        work = int(seen.sum()) * heads * dim
        _attention(work, np.ascontiguousarray(q), cache_k, cache_v, plan.context, plan.tables, np.float32(scale),
                   np.int64(window), np.float32(softcap), out)
    return out
