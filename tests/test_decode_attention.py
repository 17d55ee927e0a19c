"""Decode attention (cuda/decode_attention.cu) past test_kernels' short contexts, through the CPU
harness: ragged batches whose contexts end on, before and after a page and run past a thousand
tokens (many parts a row, blocks looping over them), GQA groups 1 to 16, head sizes 64, 128 and
256, every storage type and the fp8 cache; outputs and partials poisoned with NaN first. And a
row's bits alone, in a batch, with a graph's split count and however many blocks share its parts."""

import numpy as np
import pytest

from cuda_harness import storage
from model.ops.decode_attention import DECODE_MIN_SPLIT
from model.ops.numpy_ops import NumpyOps
from test_kernels import assert_close, decode_attention, launcher, paged_cache, rounded  # noqa: F401 (launcher)
from test_kv_fp8 import dequantized, fp8_caches, fp8_ops, scattered

NUMPY = NumpyOps()
RAGGED = [1, 15, 16, 17, 300, 1100]  # one token; a page less one, a page, a page and one; many parts


def reference(q, cache_k, cache_v, tables, context_lens, window=0):
    """NumPy's decode attention on float32 inputs as the kernel sees them."""
    seqs, heads, head_dim = q.shape
    meta = NUMPY.attention_meta([1] * seqs, list(context_lens), [list(t) for t in tables], cache_k.shape[2])
    return NUMPY.paged_attention(q, cache_k, cache_v, meta, head_dim ** -0.5, window).reshape(seqs, heads, head_dim)


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,window,lens", [
    ("float32", 2, 2, 64, 0, RAGGED), ("bfloat16", 4, 2, 128, 0, RAGGED), ("float16", 4, 1, 256, 0, RAGGED),
    ("bfloat16", 8, 1, 64, 200, RAGGED),  # group 8: two blocks of 4 heads; a sliding window in the long rows
    ("float16", 16, 1, 128, 0, RAGGED[:5]),  # 16: four blocks of 4 (the harness's slowest: no 1100)
    ("float32", 8, 1, 256, 0, RAGGED)])  # groups 1, 2, 4 above; fp32 at 8 elements a lane here
def test_decode_attention_on_ragged_contexts(launcher, dtype, heads, kv_heads, head_dim, window, lens):
    rng = np.random.default_rng(heads * head_dim + window)
    cache_k, cache_v, tables = paged_cache(rng, lens, kv_heads, head_dim)
    q = rng.standard_normal((len(lens), heads, head_dim))
    context_lens = np.array(lens, dtype=np.int32)
    got = decode_attention(launcher, storage(q, dtype), storage(cache_k, dtype), storage(cache_v, dtype), tables,
                           context_lens, dtype, DECODE_MIN_SPLIT, window=window)
    want = reference(*(rounded(x, dtype) for x in (q, cache_k, cache_v)), tables, lens, window)
    assert_close(got, want, dtype, floor=1.0)


def test_a_rows_bits_do_not_depend_on_the_batch_nor_on_the_blocks_that_loop_over_its_parts(launcher):
    """Rows alone (their own split count, a block a part), in the ragged batch (the blocks a split
    set as CudaOps sizes them for 6 rows), with every block taking all its parts, and with a
    graph's larger split count: the same bits; and every partial written (the scratch starts NaN)."""
    rng = np.random.default_rng(7)
    dtype, heads, kv_heads, head_dim = "bfloat16", 4, 1, 128
    cache_k, cache_v, tables = paged_cache(rng, RAGGED, kv_heads, head_dim)
    cache_k, cache_v = storage(cache_k, dtype), storage(cache_v, dtype)
    q = storage(rng.standard_normal((len(RAGGED), heads, head_dim)), dtype)
    context_lens = np.array(RAGGED, dtype=np.int32)
    splits = -(-max(RAGGED) // DECODE_MIN_SPLIT)
    partials = []
    batch = decode_attention(launcher, q, cache_k, cache_v, tables, context_lens, dtype, DECODE_MIN_SPLIT,
                             partials=partials)
    for looping, graph_splits in ((1, None), (None, 2 * splits)):
        other = decode_attention(launcher, q, cache_k, cache_v, tables, context_lens, dtype, DECODE_MIN_SPLIT,
                                 splits=graph_splits, looping=looping)
        assert np.array_equal(other, batch), (looping, graph_splits)
    for i in (3, 4, 5):  # 17, 300 and 1100 tokens
        alone = decode_attention(launcher, q[i:i + 1], cache_k, cache_v, tables[i:i + 1], context_lens[i:i + 1], dtype,
                                 DECODE_MIN_SPLIT)
        assert np.array_equal(alone[0], batch[i]), RAGGED[i]
    part_max, part_sum, part_acc = partials[0]
    live = part_max != -np.inf  # a row's parts past its own: empty, max -inf and nothing summed
    assert np.isfinite(part_max[live]).all() and np.isfinite(part_sum).all() and np.isfinite(part_acc).all()
    assert (part_sum[~live] == 0).all() and live[:, :, 0].all() and live[-1].all()


def test_decode_attention_on_an_fp8_cache_on_ragged_contexts():
    """CudaOps' own launch on an fp8 cache (rows of 4-byte loads, their scales after them; a group
    of 8 in two blocks of 4) against NumPy on the same dequantized values, its arrays poisoned; a
    row alone the same bits."""
    rng = np.random.default_rng(8)
    dtype, heads, kv_heads, head_dim = "bfloat16", 8, 1, 128
    ops = fp8_ops(dtype)
    k, v, tables = scattered(rng, RAGGED, kv_heads, head_dim)
    caches = fp8_caches(ops, k, v, dtype)
    q = rng.standard_normal((len(RAGGED), heads, head_dim))
    meta = ops.attention_meta([1] * len(RAGGED), RAGGED, tables, 16)
    got = ops.paged_attention(storage(q, dtype), *caches, meta, head_dim ** -0.5).reshape(len(RAGGED), heads, head_dim)
    want = reference(rounded(q, dtype), *(dequantized(c) for c in caches), tables, RAGGED)
    assert_close(got, want, dtype, floor=3.0)  # rows up to e times the standard normal's (scattered's spread)
    alone = ops.paged_attention(storage(q[4:5], dtype), *caches, ops.attention_meta([1], [300], tables[4:5], 16),
                                head_dim ** -0.5)
    assert np.array_equal(alone.reshape(heads, head_dim), got[4])
