"""The fast CPU backend: numba kernels for the ops that hold a step's time; NumPy (numpy_ops,
the oracle) for everything else, and for float32 GEMMs, which OpenBLAS does best; 8-bit weights
multiply in model/quant/.

Kernels compile once per machine (`cache=True`, into numba's cache beside this file or under
NUMBA_CACHE_DIR) and run on all cores through `prange`. What each replaces, and why:
- decode attention reads K/V in place through the block table, one block at a time, with an
  online softmax; the query heads of a KV head share each K/V load; (row, KV head) pairs run in
  parallel, and each prefetches its next block. NumPy must gather every row's blocks into a
  padded copy first. K/V rows go through two LLVM intrinsics that read float32 or widen
  float16 bits eight values at a time (the q8_0 ops keep K/V in float16, see HALF);
- prefill chunks attend in causal tiles: one GEMM per KV head for a tile's queries against only
  the keys its last token sees, then a fused causal softmax;
- the softmaxes and SiLU use an exponential written in plain arithmetic that vectorises (numba's
  np.exp is a scalar call without Intel's SVML);
- the residual add with RMSNorm, rotary, SiLU-and-mul and the K/V write are one pass each, in
  place where NumPy makes temporaries;
- the sampler draws every row that asks only for a temperature (or greedy) in one kernel over
  the batch, from C-ordered logits (a strided row costs an argmax 20 times more); rows with
  filters, penalties, a grammar or logprobs go through numpy_ops.sample.

OpenBLAS's worker threads spin for a while after each call, and so do numba's: model/__init__.py
shortens both before NumPy loads. Every kernel is compiled for C-contiguous arrays when this
module is imported (about 10 s the first time on a machine, then read from the cache).
"""

import types

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from model.ops import numpy_ops
from model.ops.llvm_ir import byte_address, element, splat
from model.ops.numpy_ops import _scratch
from model.ops.numpy_ops import (  # noqa: F401  (the rest of the ops surface, as numpy_ops has it)
    asarray,
    download,
    release,
    storage_dtype,
    to_host,
    weight,
    xp,
    zeros,
)
from model.quant import pack
from model.quant.matmul import matmul
from model.quant.strips import Strips
from model.sampling import seeded_uniform

name = "numba"
SURFACE = ("name", "xp", "storage_dtype", "asarray", "to_host", "download", "zeros", "weight", "embedding", "linear",
           "logits", "rms_norm", "add_rms_norm", "rope", "silu_and_mul", "write_kv", "attention_meta",
           "paged_attention", "sample", "release")


# K/V in float16, as llama.cpp keeps them by default: a decode step's attention reads half the
# bytes (at 64 rows of 256 tokens it reads more K/V than weights), and a cache of the same size
# holds twice the tokens. numba has no float16 type, so the cache holds the bit patterns and the
# kernels widen them (vcvtph2ps) as they read.
HALF = np.dtype(np.uint16)


def with_q8_weights() -> types.SimpleNamespace:
    """These ops, with every 2-D weight whose rows split into blocks of 32 kept in Q8_0
    (model/quant/): the projections, the embedding and the LM head; Q4_1 instead where a
    weight is exactly that (a GGUF's Q4_1 tensors); and K/V in float16. (--dtype float32 keeps
    float32 K/V too: the exact path.)"""
    ops = types.SimpleNamespace(**{op: globals()[op] for op in SURFACE})
    ops.weight = lambda w: pack.compress(w) if pack.quantizable(w) else weight(w)
    ops.storage_dtype = HALF
    return ops


def _blocks_as_float32(cache: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """(kv_heads, len(blocks) * block_size, head_dim) float32, gathered."""
    out = np.take(cache, blocks, axis=1)
    if cache.dtype == HALF:
        out = out.view(np.float16).astype(np.float32)
    return out.reshape(cache.shape[0], -1, cache.shape[3])


def embedding(table, token_ids: np.ndarray) -> np.ndarray:
    if isinstance(table, Strips):
        return table.dequantize(token_ids)
    return table[token_ids]


def linear(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    if not isinstance(w, Strips):
        return numpy_ops.linear(x, w, bias)
    out = matmul(x, w)
    if bias is not None:
        out += bias
    return out


# Below this many elements of work an op runs on one core: waking the other costs more.
PARALLEL_WORK = 1 << 15


def kernel(*signatures: str):
    """The function compiled twice when the module loads, for C-contiguous arrays: on every
    core (prange splits) and on one (prange is range). The serial twin is a copy under
    another name: numba's cache keys on the name, not the flags."""
    def compile_both(fn):
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                  fn.__closure__)
        twin.__qualname__ = fn.__qualname__ + "_serial"
        serial = njit(list(signatures), fastmath=True, cache=True, nogil=True)(twin)
        parallel = njit(list(signatures), parallel=True, fastmath=True, cache=True, nogil=True)(fn)

        def run(work: int, *args):
            return (parallel if work >= PARALLEL_WORK else serial)(*args)
        return run
    return compile_both


F1, F2, F3, F4, I1, I2 = "float32[::1]", "float32[:, ::1]", "float32[:, :, ::1]", "float32[:, :, :, ::1]", \
    "int64[::1]", "int64[:, ::1]"
H4 = "uint16[:, :, :, ::1]"  # a K/V cache of float16 bit patterns


@intrinsic
def _half_bits(typingctx, x):
    """float32 -> the bits of the nearest float16 (vcvtps2ph when vectorised)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return nbtypes.uint16(x), codegen


KV = "float32[:, :, :]"  # (tokens, kv_heads, head_dim) K or V, any strides (v is a view of qkv)


@kernel(f"void({F4}, {F4}, {I1}, {KV}, {KV})", f"void({H4}, {H4}, {I1}, {KV}, {KV})")
def _write_kv(cache_k, cache_v, slots, k, v):
    tokens, heads, dim = k.shape
    block_size = cache_k.shape[2]
    for job in prange(tokens * heads):
        t, h = job // heads, job % heads
        block, i = slots[t] // block_size, slots[t] % block_size
        if cache_k.itemsize == 2:
            for d in range(dim):
                cache_k[h, block, i, d] = _half_bits(k[t, h, d])
                cache_v[h, block, i, d] = _half_bits(v[t, h, d])
        else:
            for d in range(dim):
                cache_k[h, block, i, d] = k[t, h, d]
                cache_v[h, block, i, d] = v[t, h, d]


def write_kv(cache_k: np.ndarray, cache_v: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """K/V (tokens, kv_heads, head_dim) into the caches' flat slots, as float16 bits where the
    caches hold them."""
    _write_kv(k.size, cache_k, cache_v, np.asarray(slots, dtype=np.int64), k, v)


LOG2E, LN2_HIGH, LN2_LOW = np.float32(1.4426950408889634), np.float32(0.693145751953125), \
    np.float32(1.428606765330187e-06)


@njit(inline="always", fastmath=True)
def _exp_shifted(x, top, count, powers):
    """x[k] = exp(x[k] - top) for k < count, returning their sum; powers (int32, count or more)
    is scratch. Plain arithmetic that vectorises, as numba's np.exp does not without Intel's
    SVML: Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, and 2^n through
    the exponent bits. Inputs are clamped to [-87, 88], so the result is a normal float (about
    1e-38 for anything below, 1.7e38 for anything above)."""
    for k in range(count):
        v = min(max(x[k] - top, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(v * LOG2E + np.float32(0.5))
        r = v - n * LN2_HIGH - n * LN2_LOW
        p = np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        x[k] = p * r + np.float32(1.0)
        powers[k] = (np.int32(n) + np.int32(127)) << np.int32(23)
    scale = powers.view(np.float32)
    total = np.float32(0.0)
    for k in range(count):
        x[k] *= scale[k]
        total += x[k]
    return total


@kernel(f"void({F2}, {F2}, {F1}, float32, {F2})")
def _add_rms_norm(x, delta, gamma, eps, out):
    tokens, hidden = x.shape
    for t in prange(tokens):
        total = np.float32(0.0)
        for i in range(hidden):
            v = x[t, i] + delta[t, i]
            x[t, i] = v
            total += v * v
        inv = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = x[t, i] * inv * gamma[i]


@kernel(f"void({F2}, {F1}, float32, {F2})")
def _rms_norm(x, gamma, eps, out):
    rows, dim = x.shape
    for t in prange(rows):
        total = np.float32(0.0)
        for i in range(dim):
            total += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(dim) + np.float32(eps))
        for i in range(dim):
            out[t, i] = x[t, i] * inv * gamma[i]


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _rms_norm(flat.size, flat, gamma, np.float32(eps), out)
    return out.reshape(x.shape)


def add_rms_norm(x: np.ndarray, delta: np.ndarray | None, gamma: np.ndarray, eps: float):
    """x += delta in place (none before the first layer), then (x, rms_norm(x)), in one pass."""
    if delta is None:
        return x, rms_norm(x, gamma, eps)
    out = np.empty_like(x)
    _add_rms_norm(x.size, x, np.ascontiguousarray(delta), gamma, np.float32(eps), out)
    return x, out


@kernel(f"void({F3}, {F2}, {F2}, {F3})")
def _rope(x, cos, sin, out):
    tokens, heads, dim = x.shape
    half = dim // 2
    for t in prange(tokens):
        for h in range(heads):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, half + i]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, half + i] = b * cos[t, i] + a * sin[t, i]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, dtype=np.float32)
    _rope(x.size, np.ascontiguousarray(x), np.ascontiguousarray(cos, dtype=np.float32),
          np.ascontiguousarray(sin, dtype=np.float32), out)
    return out


@kernel(f"void({F2}, {F2})")
def _silu_and_mul(gate_up, out):
    tokens, width = out.shape
    for t in prange(tokens):
        row = out[t]
        powers = np.empty(width, dtype=np.int32)
        for i in range(width):
            row[i] = -gate_up[t, i]
        _exp_shifted(row, np.float32(0.0), width, powers)
        for i in range(width):
            row[i] = gate_up[t, i] / (np.float32(1.0) + row[i]) * gate_up[t, width + i]


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    _silu_and_mul(out.size, np.ascontiguousarray(gate_up), out)
    return out


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


def attention_meta(query_lens, context_lens, block_tables, block_size) -> AttentionPlan:
    return AttentionPlan(list(query_lens), list(context_lens), block_tables, block_size)


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
        inv = np.float32(1.0) / _exp_shifted(row, top, seen, powers[job])
        for k in range(seen):
            row[k] *= inv
        for k in range(seen, keys):
            row[k] = 0


def _prefill_attention(q, cache_k, cache_v, first, count, context, blocks, scale, out):
    """out[first:first + count] for one row's query tokens, the last count of its context:
    per tile, scores = Q K^T for every query head of a KV head in one GEMM, the causal softmax,
    then P V."""
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
                           out=_scratch("prefill scores", (kv_heads, tokens * group, seen)))
        powers = _scratch("prefill powers", (kv_heads * tokens * group, seen)).view(np.int32)
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
                total[g] = total[g] * correction + _exp_shifted(s[g], top, keys, powers)
                for d in range(dim):
                    acc[g * dim + d] *= correction
            for i in range(keys):
                for g in range(group):
                    _add_row(acc, g * dim, s[g, i], cache_v, first + i * dim, dim)
        for g in range(group):
            inv = np.float32(1.0) / total[g]
            for d in range(dim):
                out[t, (kh * group + g) * dim + d] = acc[g * dim + d] * inv


def paged_attention(q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                    plan: AttentionPlan, scale: float) -> np.ndarray:
    tokens, heads, dim = q.shape
    out = np.empty((tokens, heads * dim), dtype=np.float32)
    if len(plan.token):
        work = int(plan.context.sum()) * heads * dim
        _decode_attention(work, np.ascontiguousarray(q), cache_k, cache_v, plan.token, plan.context, plan.tables,
                          np.float32(scale), out)
    for first, count, context, blocks in plan.prefill:
        _prefill_attention(q, cache_k, cache_v, first, count, context, blocks, scale, out)
    return out


def logits(x: np.ndarray, w) -> np.ndarray:
    """The LM head, C-ordered: at 8 rows and up x @ w.T is as fast as numpy_ops' (w @ x.T).T."""
    if isinstance(w, Strips):
        return matmul(x, w)
    return x @ w.T if x.shape[0] >= 8 else np.ascontiguousarray(linear(x, w))


@kernel(f"void({F2}, {F1}, float64[::1], {I1}, {I1})")
def _draw(logits, temperature, u, rows, out):
    """Greedy (temperature 0) or a plain temperature draw by inverse CDF in token-id order,
    as numpy_ops' unfiltered case: the first token whose running sum passes u * total."""
    vocab = logits.shape[1]
    for i in prange(rows.shape[0]):
        r = rows[i]
        best, top = 0, logits[r, 0]
        for v in range(1, vocab):
            if logits[r, v] > top:
                best, top = v, logits[r, v]
        if temperature[i] == 0.0:
            out[i] = best
            continue
        inv = np.float32(1.0) / temperature[i]
        total = 0.0
        for v in range(vocab):
            total += np.exp((logits[r, v] - top) * inv)
        target, running, pick = u[i] * total, 0.0, vocab - 1
        for v in range(vocab):
            running += np.exp((logits[r, v] - top) * inv)
            if running > target:
                pick = v
                break
        out[i] = pick


def plain(p) -> bool:
    """Asks for nothing but a temperature: no filters, bias, penalties or logprobs."""
    return (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and not p.logit_bias and not p.penalized
            and p.logprobs is None)


def sample(logits: np.ndarray, params: list, prompts: list, outputs: list, rng, keys=None, masks=None):
    """numpy_ops.sample's contract; the plain rows drawn in one kernel."""
    logits = np.ascontiguousarray(logits)
    easy = [r for r, p in enumerate(params) if plain(p) and not (masks and masks[r] is not None)]
    if not easy:
        return numpy_ops.sample(logits, params, prompts, outputs, rng, keys, masks)
    token_ids = np.empty(len(params), dtype=np.int64)
    logprobs: list = [None] * len(params)
    top: list = [None] * len(params)
    rest = sorted(set(range(len(params))) - set(easy))
    if rest:
        ids, lp, tp = numpy_ops.sample(logits[rest], [params[r] for r in rest], [prompts[r] for r in rest],
                                       [outputs[r] for r in rest], rng, None,
                                       [masks[r] for r in rest] if masks else None)
        for i, r in enumerate(rest):
            token_ids[r], logprobs[r], top[r] = ids[i], lp[i], tp[i]
    chosen = [params[r] for r in easy]
    u = np.array([0.0 if p.greedy else seeded_uniform(p.seed, len(outputs[r])) if p.seed is not None else rng.random()
                  for r, p in zip(easy, chosen)])
    out = np.empty(len(easy), dtype=np.int64)
    rows = np.array(easy, dtype=np.int64)
    _draw(len(easy) * logits.shape[1], logits, np.array([p.temperature for p in chosen], dtype=np.float32), u,
          rows, out)
    token_ids[rows] = out
    return token_ids, logprobs, top
