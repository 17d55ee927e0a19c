"""Every CUDA kernel against its NumPy twin, through the CPU harness (no GPU needed): fresh random
inputs at several shapes (ragged lengths, GQA ratios 1, 3, 4 and 8, and 12 and 16 past one
block's heads, head_dim up to 256, contexts that end on and off block boundaries, decode split
over the context), outputs poisoned with NaN first so an element left unwritten fails. The
reference gets the same storage-rounded inputs. Tolerances: float32 kernels match to float32
rounding (1e-5 relative); in float16 and bfloat16 the kernel rounds its output once from fp32
while the reference does not, so they may differ by about two units in the last place of the
storage type."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher, DeviceLauncher, Poisoned, as_float, gpu_available, poisoned, storage
from model.ops.cuda_ops import CudaOps, prefill_shared_bytes, prefill_variant
from model.ops.decode_attention import decode_blocks, split_blocks
from model.ops.kernels import TENSOR_CORE_TYPES, name_expression
from model.ops.numpy_ops import NumpyOps
from model.ops.numpy_sampling import apply_penalties
from model.ops.protocol import SampleBatch

NUMPY = NumpyOps()
DTYPES = ["float32", "float16", "bfloat16"]
ULP = {"float32": 1e-5, "float16": 2 ** -10, "bfloat16": 2 ** -7}

launchers: dict = {}


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def launcher(request):
    """Every test runs through the CPU harness, and through CuPy where a GPU is present."""
    if request.param == "gpu" and not gpu_available():
        pytest.skip("no GPU: CuPy is not installed or sees no device")
    if request.param not in launchers:
        launchers[request.param] = CpuLauncher() if request.param == "cpu" else DeviceLauncher()
    return launchers[request.param]


def kernel(launcher, file: str, name: str, dtype: str, variant=None):
    return launcher.function(file, name_expression(name, dtype, variant))


def assert_close(got, want, dtype, floor=1e-3, ulps=1):
    """Relative to each value, with an absolute floor for values near zero: an attention output
    is an average of O(1) values, so its error is O(1) ulps whatever the average comes to."""
    got, want = as_float(got, dtype), np.asarray(want, dtype=np.float32)
    assert not np.isnan(got).any(), "the kernel left elements unwritten"
    tol = ULP[dtype] * (np.abs(want) + floor) * (1 if dtype == "float32" else 2) * ulps
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; worst {np.abs(got - want).max()}"


def rounded(x, dtype):
    """x as the kernel's inputs see it: rounded to the storage type, back in float32."""
    return as_float(storage(x, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 100), (5, 576), (2, 4102)])  # 4102: past the held fours, a tail
def test_rms_norm(launcher, dtype, rows, hidden):
    rng = np.random.default_rng(rows * hidden)
    x, w = rng.standard_normal((rows, hidden)) * 3, rng.standard_normal(hidden)
    xs, ws = storage(x, dtype), storage(w, dtype)
    out = poisoned((rows, hidden), dtype)
    kernel(launcher, "rms_norm.cu", "rms_norm", dtype)((rows,), (128,), (out, xs, ws, np.int32(hidden), np.float32(1e-5)))
    want = NUMPY.rms_norm(rounded(x, dtype), rounded(w, dtype), 1e-5)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(2, 64), (4, 200), (2, 2050), (2, 2602)])  # 64 threads hold 2048
def test_add_rms_norm_writes_the_sum_and_the_norm(launcher, dtype, rows, hidden):
    rng = np.random.default_rng(hidden)
    x, res, w = (rng.standard_normal((rows, hidden)), rng.standard_normal((rows, hidden)),
                 rng.standard_normal(hidden))
    xs, residual, ws = storage(x, dtype), storage(res, dtype), storage(w, dtype)
    out = poisoned((rows, hidden), dtype)
    kernel(launcher, "rms_norm.cu", "add_rms_norm", dtype)((rows,), (64,), (out, residual, xs, ws, np.int32(hidden),
                                                                   np.float32(1e-6)))
    summed = rounded(rounded(res, dtype) + rounded(x, dtype), dtype)
    assert_close(residual, summed, dtype)
    assert_close(out, NUMPY.rms_norm(summed, rounded(w, dtype), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 32), (3, 100), (7, 1536)])
@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul"])
def test_gated_activations(launcher, dtype, tokens, inter, name):
    rng = np.random.default_rng(inter)
    gate_up = rng.standard_normal((tokens, 2 * inter)) * 4
    out = poisoned((tokens, inter), dtype)
    block = 128
    kernel(launcher, "activation.cu", name, dtype)(((inter + block - 1) // block, tokens), (block,),
                                                   (out, storage(gate_up, dtype), np.int32(inter)))
    want = getattr(NUMPY, name)(rounded(gate_up, dtype))
    if name == "silu_and_mul":
        assert_close(out, want, dtype)
    else:  # 1 + tanh cancels for a negative gate: an ulp of 1 times gate * up (|gate * up| < 16) absolute
        assert_close(out, want, dtype, floor=16.0, ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_gather(launcher, dtype):
    rng = np.random.default_rng(1)
    table = storage(rng.standard_normal((50, 72)), dtype)
    ids = rng.integers(0, 50, size=9).astype(np.int32)
    out = poisoned((9, 72), dtype)
    kernel(launcher, "embedding.cu", "embedding", dtype)((9,), (64,), (out, table, ids, np.int32(72), np.int32(50),
                                                                   np.float32(1.0)))
    assert np.array_equal(out, table[ids])
    kernel(launcher, "embedding.cu", "embedding", dtype)((9,), (64,), (out, table, ids, np.int32(72), np.int32(50),
                                                                   np.float32(8.0)))  # Gemma's sqrt(hidden)
    assert_close(out, NUMPY.embedding(as_float(table, dtype), ids, 8.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_of_an_id_outside_the_table_is_zeros(launcher, dtype):
    """The sampler's -1 (no token), fed ahead to the next step, must not read outside the table."""
    table = storage(np.random.default_rng(1).standard_normal((50, 72)), dtype)
    ids = np.array([3, -1, 50, 1 << 30, 49], dtype=np.int32)
    out = poisoned((5, 72), dtype)
    kernel(launcher, "embedding.cu", "embedding", dtype)((5,), (64,), (out, table, ids, np.int32(72), np.int32(50),
                                                                   np.float32(1.0)))
    assert np.array_equal(out[[0, 4]], table[[3, 49]])
    assert not as_float(out[1:4], dtype).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4 and 8
def test_rotary_in_place_on_q_and_k(launcher, dtype, q_heads, kv_heads):
    rng = np.random.default_rng(q_heads)
    tokens, head_dim = 5, 64
    q, k = rng.standard_normal((tokens, q_heads, head_dim)), rng.standard_normal((tokens, kv_heads, head_dim))
    angles = rng.uniform(0, 50, (tokens, head_dim // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    qs, ks = storage(q, dtype), storage(k, dtype)
    kernel(launcher, "rotary.cu", "rotary", dtype)((tokens,), (128,), (qs, ks, cos, sin, np.int32(q_heads), np.int32(kv_heads),
                                                             np.int32(head_dim)))
    assert_close(qs, NUMPY.rope(rounded(q, dtype), cos, sin), dtype)
    assert_close(ks, NUMPY.rope(rounded(k, dtype), cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_through_the_slot_mapping(launcher, dtype):
    rng = np.random.default_rng(7)
    kv_heads, blocks, block_size, head_dim, tokens = 2, 6, 16, 64, 5
    cache_k = storage(rng.standard_normal((kv_heads, blocks, block_size, head_dim)), dtype)
    cache_v = storage(rng.standard_normal((kv_heads, blocks, block_size, head_dim)), dtype)
    k, v = (storage(rng.standard_normal((tokens, kv_heads, head_dim)), dtype) for _ in range(2))
    slots = np.array([17, 3, -1, 95, 40], dtype=np.int32)  # -1: a padding row, skipped
    want_k, want_v = cache_k.copy(), cache_v.copy()
    live = slots >= 0
    NUMPY.write_kv(want_k, want_v, slots[live], k[live], v[live])
    kernel(launcher, "kv_write.cu", "write_kv", dtype)((tokens,), (64,), (cache_k, cache_v, k, v, slots, np.int32(kv_heads),
                                                               np.int32(head_dim), np.int64(blocks * block_size)))
    assert np.array_equal(cache_k, want_k) and np.array_equal(cache_v, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (6, 2, 128)])
def test_rope_and_cache_from_fused_qkv_rows(launcher, dtype, heads, kv_heads, head_dim):
    """rope_write_kv against NumpyOps.rope_and_cache: the rotated q out, k rotated and v copied
    into the caches at the slots, a padding row's (-1) q computed and nothing of it cached."""
    rng = np.random.default_rng(heads + head_dim)
    tokens, blocks, block_size = 5, 6, 16
    qkv = storage(rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)), dtype)
    angles = rng.uniform(0, 6.3, (tokens, head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    slots = np.array([17, 3, -1, 95, 40], dtype=np.int32)
    caches = [storage(rng.standard_normal((kv_heads, blocks, block_size, head_dim)), dtype) for _ in range(2)]
    want_k, want_v = (as_float(c, dtype) for c in caches)
    live = slots >= 0
    want_q = NUMPY.rope_and_cache(as_float(qkv, dtype)[live], cos[live], sin[live], want_k, want_v, slots[live], heads)
    q = poisoned((tokens, heads, head_dim), dtype)
    kernel(launcher, "kv_write.cu", "rope_write_kv", dtype)((tokens,), (64,), (
        q, caches[0], caches[1], qkv, cos, sin, *(np.uint64(0),) * 3, slots, np.int32(heads),  # no norms
        np.int32(kv_heads), np.int32(head_dim), np.int32(qkv.shape[1]), np.int64(blocks * block_size), np.int32(0),
        np.float32(0)))
    assert_close(q[live], want_q, dtype)
    want_pad = NUMPY.rope(as_float(qkv, dtype)[2:3, :heads * head_dim].reshape(1, heads, head_dim), cos[2:3], sin[2:3])
    assert_close(q[2:3], want_pad, dtype)
    assert_close(caches[0], want_k, dtype)
    assert np.array_equal(as_float(caches[1], dtype), want_v)  # v is copied, not computed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,norm", [
    (8, 2, 64, "head+gate"), (6, 3, 128, "whole"), (4, 1, 256, "head+v"),
    (2, 2, 90, "head"), (3, 1, 90, "whole")])  # 90: rows summed an element at a time, not in fours
def test_rope_and_cache_with_qk_norms_is_rms_norm_then_rotary(launcher, dtype, heads, kv_heads, head_dim, norm):
    """rope_write_kv with q/k norms (Qwen3's per head, OLMoE's over the whole projection; a
    gate's rows between q and k as Qwen3.5's, v normalised as Gemma 4's): the same bits as
    rms_norm, rotary and write_kv launched one by one, and NumpyOps' norms then rotation to the
    storage type's rounding; a quarter of each head not rotated (cos 1, sin 0: a partial
    rotation's table), a padding row's q computed and nothing of it cached."""
    rng = np.random.default_rng(head_dim + heads)
    tokens, blocks, block_size = 4, 2, 8
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    gate = q_size if "gate" in norm else 0
    qkv = storage(rng.standard_normal((tokens, q_size + gate + 2 * kv_size)) * 2, dtype)
    angles = rng.uniform(0, 6.3, (tokens, head_dim // 2))
    angles[:, 3 * head_dim // 8:] = 0
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    widths = (q_size, kv_size) if norm == "whole" else (head_dim, head_dim) + (head_dim,) * ("v" in norm)
    norms = dict(zip(("q_norm", "k_norm", "v_norm"), (storage(rng.uniform(0.5, 1.5, n), dtype) for n in widths)))
    slots = np.array([9, 3, -1, 14], dtype=np.int32)
    ops = CudaOps(Poisoned(), launcher, dtype)
    fused, unfused = ([poisoned((kv_heads, blocks, block_size, head_dim), dtype) for _ in range(2)] for _ in range(2))
    q = ops.rope_and_cache(qkv, cos, sin, *fused, slots, heads, **norms, eps=1e-6)

    def op_by_op(x, heads, weight):
        x = x if weight is None else ops.rms_norm(x.reshape(-1, weight.shape[0]), weight, 1e-6)
        return x.reshape(tokens, heads, head_dim)
    want_q = ops.rope(op_by_op(qkv[:, :q_size], heads, norms["q_norm"]), cos, sin)
    k = ops.rope(op_by_op(qkv[:, -2 * kv_size:-kv_size], kv_heads, norms["k_norm"]), cos, sin)
    ops.write_kv(*unfused, slots, k, op_by_op(qkv[:, -kv_size:], kv_heads, norms.get("v_norm")))
    assert not np.isnan(as_float(q, dtype)).any()
    assert np.array_equal(q, want_q) and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(fused, unfused))

    live = slots >= 0
    want_k, want_v = (np.full((kv_heads, blocks, block_size, head_dim), np.nan, np.float32) for _ in range(2))
    reference = NUMPY.rope_and_cache(as_float(qkv, dtype)[live], cos[live], sin[live], want_k, want_v, slots[live],
                                     heads, **{name: as_float(w, dtype) for name, w in norms.items()}, eps=1e-6)
    # the normalised q and k are rounded before the rotation, as rms_norm's output is: an error
    # of the normalised values' size (about 1), not of each rotated value's
    assert_close(q[live], reference, dtype, floor=1.0)
    kept = ~np.isnan(want_k)
    assert kept.sum() == live.sum() * kv_size
    for got, want in zip(fused, (want_k, want_v)):
        assert_close(got[kept], want[kept], dtype, floor=1.0)
        assert np.isnan(as_float(got, dtype)[~kept]).all()

def decode_attention(launcher, q, cache_k, cache_v, tables, context_lens, dtype, min_split, splits=None, window=0,
                     softcap=0.0, sinks=None, looping=None, partials=None):
    """Both kernels, as the GPU path launches them: partials per split, then the reduce; splits
    as CudaOps chooses them for these contexts unless given (a graph's: more than they need),
    and the blocks a split set as CudaOps does unless `looping` gives them. The partials are
    appended to `partials` where given."""
    seqs, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = cache_k.shape
    splits = splits or max(1, -(-int(context_lens.max()) // min_split))
    part_max, part_sum = poisoned((seqs, heads, splits), "float32"), poisoned((seqs, heads, splits), "float32")
    part_acc = poisoned((seqs, heads, splits, head_dim), "float32")
    if partials is not None:
        partials.append((part_max, part_sum, part_acc))
    out = poisoned((seqs, heads, head_dim), dtype)
    instance, blocks = decode_blocks(heads, kv_heads, head_dim, dtype)
    looping = looping or split_blocks(seqs, blocks, splits, launcher.multiprocessors)
    kernel(launcher, "decode_attention.cu", "decode_attention", dtype, instance)(
        (blocks, seqs, looping), (128,),
        (part_max, part_sum, part_acc, q, cache_k, cache_v, tables, context_lens, np.int32(heads), np.int32(kv_heads),
         np.int32(head_dim), np.int32(block_size), np.int32(tables.shape[1]), np.int32(num_blocks),
         np.int32(min_split), np.int32(splits), np.float32(head_dim ** -0.5), np.int32(window), np.float32(softcap)))
    kernel(launcher, "decode_attention.cu", "decode_attention_reduce", dtype)(
        (heads, seqs), (64,), (out, part_max, part_sum, part_acc, np.int32(heads), np.int32(head_dim), np.int32(splits),
                               np.uint64(0) if sinks is None else sinks))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,min_split,window,softcap,sunk", [
    (*shape, *case) for case in [
        (512, 0, 0.0, False), (48, 0, 0.0, False),  # one split; several, so the reduce merges them
        (48, 40, 2.5, False)]  # a sliding window (rows shorter and longer than it) and Gemma 2's soft cap
    for shape in [(4, 4, 64), (8, 2, 64), (16, 2, 128), (9, 3, 64), (6, 3, 96),
                  (4, 2, 32),  # 96: a partial sub-warp; 32: four a warp
                  (16, 1, 32), (24, 2, 64),  # groups of 16 and 12: in chunks of 8
                  (8, 1, 256), (4, 2, 160),  # 8 a lane: chunks of 4; a part-run
                  (8, 1, 512), (2, 1, 288)]] + [  # 16 a lane (Gemma 4's full layers): a head a block; a part-run
    (*shape, 48, 40, 0.0, True) for shape in [(8, 2, 64), (24, 2, 64), (8, 1, 256)]])  # GPT-OSS's sinks, its window
def test_paged_decode_attention(launcher, dtype, heads, kv_heads, head_dim, min_split, window, softcap, sunk):
    rng = np.random.default_rng(heads * head_dim + min_split)
    block_size, num_blocks = 16, 40
    context_lens = np.array([1, 16, 33, 130, 47], dtype=np.int32)  # on and off block boundaries
    seqs = len(context_lens)
    blocks_needed = -(-context_lens // block_size)
    ids = rng.permutation(num_blocks)[:blocks_needed.sum()]  # scattered, never shared
    tables = np.zeros((seqs, int(blocks_needed.max())), dtype=np.int32)
    for s, start in enumerate(np.concatenate([[0], np.cumsum(blocks_needed)[:-1]])):
        tables[s, :blocks_needed[s]] = ids[start:start + blocks_needed[s]]
    q = rng.standard_normal((seqs, heads, head_dim))
    cache_k = rng.standard_normal((kv_heads, num_blocks, block_size, head_dim))
    cache_v = rng.standard_normal((kv_heads, num_blocks, block_size, head_dim))
    sinks = (2.0 * rng.standard_normal(heads)).astype(np.float32) if sunk else None
    got = decode_attention(launcher, storage(q, dtype), storage(cache_k, dtype), storage(cache_v, dtype), tables,
                           context_lens, dtype, min_split, window=window, softcap=softcap, sinks=sinks)
    meta = NUMPY.attention_meta([1] * seqs, context_lens.tolist(), tables.tolist(), block_size)
    want = NUMPY.paged_attention(rounded(q, dtype), rounded(cache_k, dtype), rounded(cache_v, dtype), meta,
                                 head_dim ** -0.5, window, softcap, sinks).reshape(seqs, heads, head_dim)
    assert_close(got, want, dtype, floor=1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (8, 1, 256)])
def test_a_rows_decode_attention_is_the_same_bits_in_any_batch(launcher, dtype, heads, kv_heads, head_dim):
    """A sequence's context splits by its own length only: alone, beside a longer row (more
    splits in the grid), and with a graph's fixed split count, its output is the same bits."""
    rng = np.random.default_rng(11)
    min_split = 48
    context_lens = np.array([130, 400], dtype=np.int32)
    cache_k, cache_v, tables = paged_cache(rng, context_lens, kv_heads, head_dim)
    cache_k, cache_v = storage(cache_k, dtype), storage(cache_v, dtype)
    q = storage(rng.standard_normal((2, heads, head_dim)), dtype)
    alone = decode_attention(launcher, q[:1], cache_k, cache_v, tables[:1], context_lens[:1], dtype, min_split)
    beside = decode_attention(launcher, q, cache_k, cache_v, tables, context_lens, dtype, min_split)
    graphed = decode_attention(launcher, q, cache_k, cache_v, tables, context_lens, dtype, min_split, splits=16)
    assert np.array_equal(alone[0], beside[0]) and np.array_equal(alone[0], graphed[0])
    assert np.array_equal(beside, graphed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # prefill on CUDA cores; on tensor cores
def test_cuda_ops_attend_with_gemma_heads_in_groups_of_16(dtype):
    """CudaOps.paged_attention's own launches at head_dim 256 with 16 query heads a KV head: the
    decode instance and its chunks, and each prefill kernel's dynamic shared memory past 48 KB
    (the harness fails a launch whose limit was not raised first)."""
    ops, rng = CudaOps(np, CpuLauncher(), dtype), np.random.default_rng(5)
    heads, kv_heads, head_dim, context_lens = 32, 2, 256, [12, 21]
    cache_k, cache_v, tables = paged_cache(rng, context_lens, kv_heads, head_dim)
    for query_lens in ([12, 5], [1, 1]):  # a prompt and a chunk on a prefix; two decode rows
        q = rng.standard_normal((sum(query_lens), heads, head_dim))
        plan = (query_lens, context_lens, tables.tolist(), 16)
        got = ops.paged_attention(storage(q, dtype), storage(cache_k, dtype), storage(cache_v, dtype),
                                  ops.attention_meta(*plan), head_dim ** -0.5)
        want = NUMPY.paged_attention(rounded(q, dtype), rounded(cache_k, dtype), rounded(cache_v, dtype),
                                     NUMPY.attention_meta(*plan), head_dim ** -0.5)
        assert_close(got, want, dtype, floor=1.0)


def paged_cache(rng, context_lens, kv_heads, head_dim, block_size=16):
    """Random caches and block tables with each sequence's blocks scattered over the pool."""
    blocks_needed = -(-np.asarray(context_lens) // block_size)
    num_blocks = int(blocks_needed.sum()) + 5
    ids = rng.permutation(num_blocks)
    tables = np.zeros((len(context_lens), int(blocks_needed.max())), dtype=np.int32)
    for s, start in enumerate(np.concatenate([[0], np.cumsum(blocks_needed)[:-1]])):
        tables[s, :blocks_needed[s]] = ids[start:start + blocks_needed[s]]
    shape = (kv_heads, num_blocks, block_size, head_dim)
    return rng.standard_normal(shape), rng.standard_normal(shape), tables


PREFILL_KERNELS = [("prefill_attention", dtype, 16) for dtype in DTYPES] + [
    ("prefill_attention_tc", dtype, 64) for dtype in TENSOR_CORE_TYPES]  # (kernel, dtype, rows a block)


@pytest.mark.parametrize("name,dtype,rows_per_block", PREFILL_KERNELS)
# (16, 1, 32): a group of 16; 256: 82 KB of shared memory on CUDA cores, two value passes on tensor
# cores; 160: a second value pass of 2 tiles; 512 (Gemma 4's full layers): 16 a lane, 164 KB,
# four value passes
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,softcap,sunk", [
    (*shape, *case) for case in [(0, 0.0, False), (13, 2.5, False)] for shape in
    [(4, 4, 64), (8, 2, 64), (16, 2, 128), (9, 3, 64), (6, 2, 96), (16, 1, 32), (4, 2, 256), (2, 1, 160),
     (4, 1, 512)]] + [
    (8, 2, 64, 13, 0.0, True), (16, 1, 32, 13, 0.0, True)])  # GPT-OSS's sinks with its window, on two shapes
def test_paged_prefill_attention(launcher, name, dtype, rows_per_block, heads, kv_heads, head_dim, window, softcap,
                                 sunk):
    """Whole prompts, chunks on a cached prefix (on and off block boundaries), and a decode row,
    in one launch; on CUDA cores, and on tensor cores (WMMA) for the 16-bit types; with a
    sliding window shorter than most rows and soft-capped scores too, and with GPT-OSS's sinks."""
    rng = np.random.default_rng(heads * head_dim)
    query_lens = [37, 16, 5, 1, 20]
    context_lens = [37, 48, 21, 30, 52]  # 37: a whole prompt; the rest: chunks after a prefix
    cache_k, cache_v, tables = paged_cache(rng, context_lens, kv_heads, head_dim)
    tokens = sum(query_lens)
    q = rng.standard_normal((tokens, heads, head_dim))
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    out = poisoned((tokens, heads, head_dim), dtype)
    sinks = (2.0 * rng.standard_normal(heads)).astype(np.float32) if sunk else None
    prefill = kernel(launcher, f"{name}.cu", name, dtype, prefill_variant(name, head_dim))
    shared = prefill.max_dynamic_shared_size_bytes = prefill_shared_bytes(name, head_dim, out.itemsize)
    prefill((-(-max(query_lens) * (heads // kv_heads) // rows_per_block), len(query_lens), kv_heads), (128,),
        (out, storage(q, dtype), storage(cache_k, dtype), storage(cache_v, dtype), starts,
         np.array(context_lens, dtype=np.int32), tables, np.int32(heads), np.int32(kv_heads), np.int32(head_dim),
         np.int32(16), np.int32(tables.shape[1]), np.int32(cache_k.shape[1]), np.float32(head_dim ** -0.5),
         np.int32(window), np.float32(softcap), np.uint64(0) if sinks is None else sinks), shared_mem=shared)
    meta = NUMPY.attention_meta(query_lens, context_lens, tables.tolist(), 16)
    want = NUMPY.paged_attention(rounded(q, dtype), rounded(cache_k, dtype), rounded(cache_v, dtype), meta,
                                 head_dim ** -0.5, window, softcap, sinks).reshape(tokens, heads, head_dim)
    assert_close(out, want, dtype, floor=1.0)


def run_sample(launcher, logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, uniform=None, top_n_sigma=-1.0):
    rows, vocab = logits.shape
    per_row = lambda v, t: np.full(rows, v, dtype=t)  # noqa: E731
    out = np.full(rows, -7, dtype=np.int32)
    uniform = per_row(0.5, np.float32) if uniform is None else np.asarray(uniform, dtype=np.float32)
    launcher.function("sampling.cu", "sample")((rows,), (64,), (
        out, np.ascontiguousarray(logits, dtype=np.float32), per_row(temperature, np.float32),
        per_row(top_k, np.int32), per_row(top_p, np.float32), per_row(min_p, np.float32),
        per_row(top_n_sigma, np.float32), uniform, np.int32(vocab)))
    return out


def kept_set(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, top_n_sigma=-1.0) -> set:
    """model/ops/numpy_sampling.pick's candidates, as a set: min-p and top-nσ (the published
    definition: logits at least the largest minus n standard deviations), then top-k, then top-p
    of what is left."""
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    order = np.lexsort((np.arange(len(probs)), -probs))
    order = order[probs[order] >= min_p * probs.max()]
    if top_n_sigma > 0:
        order = order[logits[order] >= logits.max() - top_n_sigma * logits.astype(np.float64).std()]
    if top_k:
        order = order[:top_k]
    kept = probs[order] / probs[order].sum()
    return set(order[(np.cumsum(kept) - kept) < top_p].tolist())


def test_greedy_is_the_argmax(launcher):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    logits[2, [10, 500]] = 9.0  # a tie: the lowest id wins, as np.argmax
    assert np.array_equal(run_sample(launcher, logits, temperature=0.0), np.argmax(logits, axis=1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_without_a_finite_logit_gets_no_token(launcher, temperature):
    """NaN or -inf throughout (a model that overflowed): -1, which no kernel indexes with and the
    runner fails the request on; the other rows draw as before."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    logits[1], logits[3] = np.nan, -np.inf
    got = run_sample(launcher, logits, temperature=temperature, uniform=np.full(4, 0.3))
    assert got[1] == got[3] == -1
    assert np.array_equal(got[[0, 2]], run_sample(launcher, logits[[0, 2]], temperature=temperature,
                                                  uniform=np.full(2, 0.3)))
    counts = np.zeros((2, 300), dtype=np.int32)
    launcher.function("penalties.cu", "count_tokens")((1,), (32,), (
        counts, np.array([0, 1, -1, -1], dtype=np.int32), got, np.int32(4), np.int32(300)))
    assert counts[0].sum() == 1 and counts[1].sum() == 0  # row 1's -1 counts nothing
    chosen = np.zeros(4, dtype=np.float32)
    launcher.function("logprobs.cu", "logprobs")((4,), (64,), (
        chosen, np.zeros((4, 1), np.int32), np.zeros((4, 1), np.float32), logits, got, np.zeros(4, np.int32),
        np.int32(300), np.int32(1)))
    assert np.isnan(chosen[1]) and np.isfinite(chosen[[0, 2]]).all()


def test_draws_follow_the_distribution(launcher):
    """Evenly spaced uniforms: token j is drawn about N * p_j times (inverse CDF in id order)."""
    rng = np.random.default_rng(1)
    row = rng.standard_normal(100).astype(np.float32) * 2
    n = 1000
    picks = run_sample(launcher, np.repeat(row[None], n, axis=0), temperature=0.7, uniform=(np.arange(n) + 0.5) / n)
    probs = np.exp((row - row.max()) / 0.7)
    probs /= probs.sum()
    counts = np.bincount(picks, minlength=100)
    assert np.abs(counts - n * probs).max() <= 2


@pytest.mark.parametrize("filters", [{"top_k": 5}, {"top_p": 0.6}, {"min_p": 0.2}, {"top_k": 20, "top_p": 0.8},
                                     {"min_p": 0.05, "top_k": 8, "top_p": 0.9}, {"top_n_sigma": 1.0},
                                     {"top_n_sigma": 2.0, "top_k": 30, "top_p": 0.95}])
def test_filters_pick_exactly_the_kept_set(launcher, filters):
    """Uniforms spread evenly over [0, 1): every pick is in numpy_ops' kept set, and every kept
    token with more than 1.5/n of the kept mass is picked (the thresholds are neither too tight
    nor too loose)."""
    rng = np.random.default_rng(len(filters))
    row = rng.standard_normal(400).astype(np.float32) * 3
    kept = kept_set(row, 0.9, **filters)
    n = 200
    picks = run_sample(launcher, np.repeat(row[None], n, axis=0), temperature=0.9, uniform=(np.arange(n) + 0.5) / n,
                       **filters)
    assert set(picks.tolist()) <= kept
    weights = np.exp((row - row.max()) / 0.9)
    share = {t: weights[t] / weights[list(kept)].sum() for t in kept}
    assert {t for t in kept if share[t] > 1.5 / n} <= set(picks.tolist())


def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch(launcher):
    from model.sampling import seeded_uniform

    rng = np.random.default_rng(3)
    batch = rng.standard_normal((8, 500)).astype(np.float32)
    u = [seeded_uniform(1234, 5)] + rng.random(7).tolist()
    alone = run_sample(launcher, batch[:1], temperature=1.0, top_p=0.95, uniform=u[:1])
    together = run_sample(launcher, batch, temperature=1.0, top_p=0.95, uniform=u)
    assert alone[0] == together[0]


def test_penalties_and_logit_bias_match_numpy_ops(launcher):
    """Counts kept on the device in each request's slot and updated by count_tokens step by step
    give the same adjusted logits as NumpyOps' penalties over the whole history, bias included;
    a row without a slot (-1) gets its bias only."""
    from model.sampling import SamplingParams

    rng = np.random.default_rng(4)
    rows, vocab, slots = 4, 300, 6
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                             logit_bias={5: 3.0, 17: -100.0}),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(frequency_penalty=-0.4, logit_bias={299: 1.5}),
              SamplingParams(logit_bias={3: -2.0})]
    count_rows = np.array([5, 0, 2, -1], dtype=np.int32)
    prompts = [rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in range(rows)]
    outputs = [[] for _ in range(rows)]
    counts = np.zeros((slots, vocab), dtype=np.int32)
    seen = np.zeros((slots, vocab), dtype=np.uint8)
    for slot, prompt in zip(count_rows, prompts):
        if slot >= 0:
            seen[slot, prompt] = 1
    for _ in range(12):  # steps: each row's sampled token joins its slot's counts on the device
        tokens = rng.integers(0, vocab, rows).astype(np.int32)
        tokens[0] = 5  # a biased token, repeated
        launcher.function("penalties.cu", "count_tokens")((1,), (32,), (counts, count_rows, tokens, np.int32(rows),
                                                                          np.int32(vocab)))
        for r in range(rows):
            outputs[r].append(int(tokens[r]))
    assert counts[[1, 3, 4]].sum() == 0  # slots no row holds stay untouched
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    offsets = np.cumsum([0] + [len(p.logit_bias) for p in params]).astype(np.int32)
    bias_ids = np.array([t for p in params for t in p.logit_bias], dtype=np.int32)
    bias_values = np.array([v for p in params for v in p.logit_bias.values()], dtype=np.float32)
    got = logits.copy()
    launcher.function("penalties.cu", "apply_penalties")((rows,), (64,), (
        got, counts, seen, count_rows, np.array([p.repetition_penalty for p in params], dtype=np.float32),
        np.array([p.presence_penalty for p in params], dtype=np.float32),
        np.array([p.frequency_penalty for p in params], dtype=np.float32), offsets, bias_ids, bias_values,
        np.int32(vocab)))
    for r, p in enumerate(params):
        want = logits[r].copy()
        if p.logit_bias:
            want[list(p.logit_bias)] += np.array(list(p.logit_bias.values()), dtype=np.float32)
        apply_penalties(want, p, prompts[r], outputs[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-5)
    assert not np.array_equal(got[0], logits[0])  # the penalties did something


def test_logprobs_of_the_token_and_the_top_n_match_numpy_ops(launcher):
    from model.sampling import SamplingParams

    rng = np.random.default_rng(6)
    rows, vocab, max_n = 3, 500, 5
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[1, [40, 7]] = logits[1].max() + 1  # a tie at the top: the lower id first
    top_n = np.array([5, 3, 0], dtype=np.int32)
    params = [SamplingParams(temperature=0.0, logprobs=int(n)) for n in top_n]
    want = NUMPY.sample(logits, SampleBatch(params, [[]] * rows, [[]] * rows, rng))
    tokens, want_chosen, want_top = want.token_ids, want.logprobs, want.top_logprobs
    tokens[2] = 123  # any token's logprob, not only the argmax
    want_chosen[2] = float((logits[2] - np.log(np.exp(logits[2] - logits[2].max()).sum()) - logits[2].max())[123])
    chosen = np.full(rows, np.nan, dtype=np.float32)
    top_ids = np.full((rows, max_n), -1, dtype=np.int32)
    top_values = np.full((rows, max_n), np.nan, dtype=np.float32)
    launcher.function("logprobs.cu", "logprobs")((rows,), (64,), (
        chosen, top_ids, top_values, logits, tokens.astype(np.int32), top_n, np.int32(vocab), np.int32(max_n)))
    np.testing.assert_allclose(chosen, want_chosen, rtol=1e-5, atol=1e-5)
    for r in range(rows):
        assert top_ids[r, :top_n[r]].tolist() == [t for t, _ in want_top[r]]
        np.testing.assert_allclose(top_values[r, :top_n[r]], [v for _, v in want_top[r]], rtol=1e-5, atol=1e-5)
    assert top_ids[1, :2].tolist() == [7, 40]
