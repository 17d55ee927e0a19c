"""Paged attention in numba, one kernel for every query token: a decode row's, and each of a
prefill chunk's, which reads the K/V of the positions up to its own as a decode row there would.

The kernel works on tiles: up to a few consecutive query tokens of one row and all the query
heads of one KV head (a decode row is a tile of one token). A tile walks its row's blocks once,
flash-attention style: each block's keys are scored against every query of the tile while they
sit in L1, then each query folds the block into its running max, sum and output (online
softmax); no score matrix is kept, blocks past a query's position are skipped, and so are
blocks before a sliding window. K blocks are stored head-dim-major (model/ops/numba_rowwise
.write_kv), so sixteen keys' scores are one vector and each of a query's dimensions one fused
multiply-add into it; V rows are added to the output sixteen dimensions a vector.

A query's arithmetic never depends on its tile: each score is one chain of fused multiply-adds
over the head dimension in order, each block's softmax and output update is the query's own,
and blocks come in position order. So a token's output is the same bits whatever shares the
step, however its prompt was chunked, and whether it came as a decode row or in a prefill chunk
(tests/test_batch_invariance.py, tests/test_prefill_attention.py). K/V are float32 or float16
bits, widened as they are read (the q8_0 ops keep K/V in float16 where the target has F16C, see
model/ops/numba_kernels.QUANTIZED_KV), or q8_0 (--cache-type-k q8_0: int8 values and a scale per
token, model/kv_cache.py), always widened a block at a time into float32 tiles, so that every
query reads a key as the same float.
"""

import numpy as np
from numba import prange

from model.ops.attention_blocks import (LANES, accumulate, block_scores, fold, prefetch, widen, widen_keys,
                                        widen_values)
from model.ops.numba_kernels import B4, F1, F2, F3, F4, H4, I1, I2, kernel

TILE_FLOATS = 4096  # a tile's queries (and their outputs) in floats: both stay in L1
NO_SINKS = NO_SCALES = np.zeros(0, dtype=np.float32)


class AttentionPlan:
    """A step's attention, planned once for every layer: for each query token on the step's axis,
    its context (the positions up to and including its own); for each row, its block table; and
    the step's tiles of consecutive tokens of one row, for each tile size asked for."""

    def __init__(self, query_lens, context_lens, block_tables, block_size):
        self.query_lens = np.asarray(query_lens, dtype=np.int64)
        context_lens = np.asarray(context_lens, dtype=np.int64)
        rows = np.repeat(np.arange(len(self.query_lens)), self.query_lens)  # each token's row
        self.first = np.concatenate([[0], np.cumsum(self.query_lens)[:-1]]).astype(np.int64)  # each row's first token
        self.context = context_lens[rows] - self.query_lens[rows] + 1 + np.arange(len(rows)) - self.first[rows]
        self.tables = np.zeros((len(self.query_lens), -(-int(context_lens.max(initial=0)) // block_size)),
                               dtype=np.int64)
        for r, c in enumerate(context_lens):
            used = -(-int(c) // block_size)
            self.tables[r, :used] = block_tables[r][:used]
        self._tiles: dict[int, tuple[np.ndarray, ...]] = {}

    def tiles(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tiles of up to size tokens, as (row, first token, token count) arrays, and the order the
        cores take them in: heaviest and lightest alternating, so each core's share of a causal
        prompt (whose later tiles read more) is about half the work."""
        if size not in self._tiles:
            per_row = -(-self.query_lens // size)
            row = np.repeat(np.arange(len(per_row)), per_row)
            index = np.arange(len(row)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
            first = self.first[row] + index * size
            count = np.minimum(size, self.first[row] + self.query_lens[row] - first)
            heaviest = np.argsort(-(self.context[first + count - 1] * count), kind="stable")
            order = np.empty_like(heaviest)
            order[0::2], order[1::2] = heaviest[:(len(row) + 1) // 2], heaviest[(len(row) + 1) // 2:][::-1]
            self._tiles[size] = (row, first, count, order)
        return self._tiles[size]


@kernel(*(f"void({F3}, {C}, {C}, {F1}, {F1}, {I1}, {I2}, {I1}, {I1}, {I1}, {I1}, float32, int64, float32, {F1}, {F2})"
          for C in (F4, H4, B4)))
def _attention(q, cache_k, cache_v, k_scales, v_scales, context, tables, tile_row, tile_first, tile_count, order,
               scale, window, softcap, sinks, out):
    """For each query token t: out[t] = softmax(q K^T * scale) V over its context[t] cached
    positions (the last `window` of them for a sliding window), block by block with a running
    max and sum per query; scores soft-capped where softcap is not 0, and each head's sink
    (where sinks is not empty) added to the sum at the end. Each job is one tile (a run of one
    row's tokens) and one KV head, with the query heads that share it. k_scales and v_scales:
    a q8_0 cache seen as float32 (its scales), else empty."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, cache_blocks, block_size = cache_k.shape[0], cache_k.shape[1], cache_k.shape[2]
    width = cache_k.shape[3]  # a cached row: dim values, and a q8_0 row's scale after them
    quantized = k_scales.shape[0] > 0
    group = heads // kv_heads
    tiles = order.shape[0]
    for job in prange(tiles * kv_heads):  # every tile of one head, then the next head: even halves
        tile, kh = order[job % tiles], job // tiles
        row, first, count = tile_row[tile], tile_first[tile], tile_count[tile]
        queries = count * group  # query r: token first + r // group, head kh * group + r % group
        qs = np.empty(queries * dim, dtype=np.float32)
        acc = np.zeros(queries * dim, dtype=np.float32)
        m = np.full(queries, np.float32(-3e38), dtype=np.float32)  # finite: exp(m - top) is 0, never NaN
        total = np.zeros(queries, dtype=np.float32)
        corrections = np.empty(queries, dtype=np.float32)
        s = np.empty(queries * block_size + LANES, dtype=np.float32)  # fold reads whole vectors
        widened = quantized or (queries > 8 and (block_size * dim) % LANES == 0)  # K and V read by several passes
        keys = np.empty(block_size * dim if widened else 0, dtype=np.float32)
        values = np.empty(block_size * dim if widened else 0, dtype=np.float32)
        for r in range(queries):
            for d in range(dim):
                qs[r * dim + d] = q[first + r // group, kh * group + r % group, d] * scale
        earliest = max(0, context[first] - window) if window > 0 else 0  # the first position any query sees
        blocks = -(-context[first + count - 1] // block_size)
        for b in range(earliest // block_size, blocks):
            base = (kh * cache_blocks + tables[row, b]) * block_size * width  # the block's flat offset, K and V
            if b + 1 < blocks:  # the next block's K and V, while this one computes
                following = (kh * cache_blocks + tables[row, b + 1]) * block_size * width
                for line in range(0, block_size * width, 64 // cache_k.itemsize):
                    prefetch(cache_k, following + line)
                    prefetch(cache_v, following + line)
            if quantized:
                widen_keys(cache_k, base, k_scales, block_size, dim, keys)
                widen_values(cache_v, base, v_scales, block_size, dim, values)
                block_scores(qs, queries, dim, keys, 0, block_size, s)
            elif widened:
                widen(cache_k, base, block_size * dim, keys)
                widen(cache_v, base, block_size * dim, values)
                block_scores(qs, queries, dim, keys, 0, block_size, s)
            else:
                block_scores(qs, queries, dim, cache_k, base, block_size, s)
            for token in range(count):
                n = context[first + token]
                start = max(0, n - window) if window > 0 else 0
                lo, hi = max(0, start - b * block_size), min(block_size, n - b * block_size)
                if hi <= lo:  # the block is past this token, or before its window
                    continue
                for r in range(token * group, (token + 1) * group):
                    if softcap > 0:
                        for i in range(r * block_size + lo, r * block_size + hi):
                            s[i] = softcap * np.tanh(s[i] / softcap)
                    fold(s, r * block_size, block_size, lo, hi, m, total, corrections, r)
            last_start = max(0, context[first + count - 1] - window) if window > 0 else 0
            if last_start <= b * block_size and context[first] >= (b + 1) * block_size:  # whole for every token
                if widened:
                    accumulate(acc, 0, queries, corrections, s, block_size, 0, block_size, values, 0, dim)
                else:
                    accumulate(acc, 0, queries, corrections, s, block_size, 0, block_size, cache_v, base, dim)
                continue
            for token in range(count):
                n = context[first + token]
                start = max(0, n - window) if window > 0 else 0
                lo, hi = max(0, start - b * block_size), min(block_size, n - b * block_size)
                if hi > lo:
                    if widened:
                        accumulate(acc, token * group, group, corrections, s, block_size, lo, hi - lo, values, 0, dim)
                    else:
                        accumulate(acc, token * group, group, corrections, s, block_size, lo, hi - lo, cache_v,
                                    base, dim)
        for r in range(queries):
            if sinks.shape[0]:
                total[r] += np.exp(sinks[kh * group + r % group] - m[r])
            inv = np.float32(1.0) / total[r]
            for d in range(dim):
                out[first + r // group, (kh * group + r % group) * dim + d] = acc[r * dim + d] * inv


def tile_tokens(group: int, dim: int) -> int:
    """Tokens a tile holds: as many as keep its queries and outputs in L1, at least one."""
    return max(1, TILE_FLOATS // (group * dim))


def paged_attention(q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray, plan: AttentionPlan,
                    scale: float, window: int = 0, softcap: float = 0.0, sinks=None) -> np.ndarray:
    tokens, heads, dim = q.shape
    out = np.empty((tokens, heads * dim), dtype=np.float32)
    if tokens:
        seen = np.minimum(plan.context, window) if window else plan.context
        work = int(seen.sum()) * heads * dim
        row, first, count, order = plan.tiles(tile_tokens(heads // cache_k.shape[0], dim))
        k_scales, v_scales = (part.reshape(-1).view(np.float32) if part.dtype == np.int8 else NO_SCALES
                              for part in (cache_k, cache_v))
        _attention(work, np.ascontiguousarray(q), cache_k, cache_v, k_scales, v_scales, plan.context, plan.tables,
                   row, first, count, order, np.float32(scale), np.int64(window), np.float32(softcap),
                   NO_SINKS if sinks is None else sinks, out)
    return out
