"""Paged attention in numba: decode rows read K/V in place through the block table; prefill
chunks attend in causal tiles. The LLVM intrinsics that read K/V rows live here too.

- decode attention reads K/V one block at a time, with an online softmax; the query heads of a
  KV head share each K/V load; (row, KV head) pairs run in parallel, and each prefetches its
  next block. NumPy must gather every row's blocks into a padded copy first. K/V rows go through
  two LLVM intrinsics that read float32 or widen float16 bits eight values at a time (the q8_0
  ops keep K/V in float16 where the target has F16C, see model/ops/numba_kernels.QUANTIZED_KV);
- prefill chunks attend in causal tiles: one GEMM per KV head for a tile's queries against only
  the keys its last token sees, then a fused causal softmax.
"""

import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from model.ops.llvm_ir import byte_address, element, splat
from model.ops.numba_kernels import F2, F3, F4, H4, HALF, I1, I2, exp_shifted, kernel


def _blocks_as_float32(cache: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """(kv_heads, len(blocks) * block_size, head_dim) float32, gathered."""
    out = np.take(cache, blocks, axis=1)
    if cache.dtype == HALF:
        out = out.view(np.float16).astype(np.float32)
    return out.reshape(cache.shape[0], -1, cache.shape[3])


class AttentionPlan:
    """A step's attention, planned once for every layer: decode rows (one query token) for the
    kernel, the others (prefill chunks) one by one in causal tiles."""

    def __init__(self, query_lens, context_lens, block_tables, block_size):
        starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
        decode = [r for r, n in enumerate(query_lens) if n == 1]
        self.token = starts[decode]
        self.context = np.array([context_lens[r] for r in decode], dtype=np.int64)
        width = max((-(-int(c) // block_size) for c in self.context), default=0)
        self.tables = np.zeros((len(decode), width), dtype=np.int64)
        for i, r in enumerate(decode):
            used = -(-context_lens[r] // block_size)
            self.tables[i, :used] = block_tables[r][:used]
        # (first token on the step's axis, query tokens, context, the blocks it uses)
        self.prefill = [(int(starts[r]), n, context_lens[r],
                         np.asarray(block_tables[r][:-(-context_lens[r] // block_size)], dtype=np.int64))
                        for r, n in enumerate(query_lens) if n != 1]


# Query tokens a prefill tile holds: tile i attends only to the keys its last token sees, so a
# long prompt computes about half the score matrix instead of all of it.
PREFILL_TILE = 128


@kernel(f"void({F3}, int64, int64, int32[:, ::1])")
def _causal_softmax(scores, group, first, powers):
    """Each row of scores[h], for query token i // group of a tile whose first token is at
    position first: softmax over keys 0..first + i // group, zero after."""
    heads, rows, keys = scores.shape
    for job in prange(heads * rows):
        h, i = job // rows, job % rows
        seen = min(keys, first + i // group + 1)
        row = scores[h, i]
        top = row[0]
        for k in range(1, seen):
            top = max(top, row[k])
        inv = np.float32(1.0) / exp_shifted(row, top, seen, powers[job])
        for k in range(seen):
            row[k] *= inv
        for k in range(seen, keys):
            row[k] = 0


def _prefill_attention(q, cache_k, cache_v, first, count, context, blocks, scale, out, scratch):
    """out[first:first + count] for one row's query tokens, the last count of its context:
    per tile, scores = Q K^T for every query head of a KV head in one GEMM, the causal softmax,
    then P V. scratch(name, shape) lends reused float32 buffers (NumpyOps.scratch)."""
    kv_heads, _, block_size, dim = cache_k.shape
    group = q.shape[1] // kv_heads
    k, v = _blocks_as_float32(cache_k, blocks), _blocks_as_float32(cache_v, blocks)
    # (kv head, token, query head of the group, dim): a tile of tokens is one matrix per KV head
    queries = (q[first:first + count] * np.float32(scale)).reshape(count, kv_heads, group, dim).transpose(1, 0, 2, 3)
    queries = np.ascontiguousarray(queries)
    for t0 in range(0, count, PREFILL_TILE):
        tokens = min(PREFILL_TILE, count - t0)
        position = context - count + t0  # of the tile's first query token
        seen = position + tokens
        tile = queries[:, t0:t0 + tokens].reshape(kv_heads, tokens * group, dim)
        scores = np.matmul(tile, k[:, :seen].transpose(0, 2, 1),
                           out=scratch("prefill scores", (kv_heads, tokens * group, seen)))
        powers = scratch("prefill powers", (kv_heads * tokens * group, seen)).view(np.int32)
        _causal_softmax(scores.size, scores, group, position, powers)
        o = np.matmul(scores, v[:, :seen]).reshape(kv_heads, tokens, group, dim)
        out[first + t0:first + t0 + tokens] = o.transpose(1, 0, 2, 3).reshape(tokens, -1)


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


@kernel(f"void({F3}, {F4}, {F4}, {I1}, {I1}, {I2}, float32, {F2})",
        f"void({F3}, {H4}, {H4}, {I1}, {I1}, {I2}, float32, {F2})")
def _decode_attention(q, cache_k, cache_v, token, context, tables, scale, out):
    """One query token per row: out[token[r]] = softmax(q K^T * scale) V over the row's
    context[r] cached positions, block by block with a running max and sum per query head.
    K/V rows are float32 or float16 bits, read through _dot_row and _add_row."""
    rows = token.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, cache_blocks, block_size = cache_k.shape[0], cache_k.shape[1], cache_k.shape[2]
    group = heads // kv_heads
    for job in prange(rows * kv_heads):
        r, kh = job // kv_heads, job % kv_heads
        t, n = token[r], context[r]
        qs = np.empty(group * dim, dtype=np.float32)  # query head g at g * dim
        acc = np.zeros(group * dim, dtype=np.float32)
        m = np.full(group, -np.inf, dtype=np.float32)
        total = np.zeros(group, dtype=np.float32)
        s = np.empty((group, block_size), dtype=np.float32)
        powers = np.empty(block_size, dtype=np.int32)
        for g in range(group):
            for d in range(dim):
                qs[g * dim + d] = q[t, kh * group + g, d] * scale
        blocks = -(-n // block_size)
        for b in range(blocks):
            keys = min(block_size, n - b * block_size)
            first = (kh * cache_blocks + tables[r, b]) * block_size * dim  # the block's flat offset
            if b + 1 < blocks:  # the next block's K and V, while this one computes
                following = (kh * cache_blocks + tables[r, b + 1]) * block_size * dim
                for line in range(0, block_size * dim, 64 // cache_k.itemsize):
                    _prefetch(cache_k, following + line)
                    _prefetch(cache_v, following + line)
            for i in range(keys):
                for g in range(group):
                    s[g, i] = _dot_row(qs, g * dim, cache_k, first + i * dim, dim)
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


def paged_attention(q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray, plan: AttentionPlan, scale: float,
                    scratch) -> np.ndarray:
    tokens, heads, dim = q.shape
    out = np.empty((tokens, heads * dim), dtype=np.float32)
    if len(plan.token):
        work = int(plan.context.sum()) * heads * dim
        _decode_attention(work, np.ascontiguousarray(q), cache_k, cache_v, plan.token, plan.context, plan.tables,
                          np.float32(scale), out)
    for first, count, context, blocks in plan.prefill:
        _prefill_attention(q, cache_k, cache_v, first, count, context, blocks, scale, out, scratch)
    return out
