"""The fp8 K/V cache on CUDA (--kv-cache-dtype fp8), through the CPU harness: the e4m3 conversions
against a NumPy reference over all 256 codes and edge floats, the K/V writes against a NumPy
quantizer bit for bit (codes and scales), decode and prefill attention (CUDA and tensor cores)
on an fp8 cache against NumPy's attention over the same values dequantized (tight) and over the
float K/V (loose: the rounding's cost), a row's output the same bits alone, in a batch and
however its prompt is chunked, the tiny model's forward pass against float16 K/V, blocks that
spill and reload byte for byte, and the flags' refusals in one line.

The layout (model/kv_cache.py, cuda/kv_write.cu): K and V alike (kv_heads, blocks, block_size,
head_dim + 4) uint8, each token's and head's row its head_dim e4m3 codes of x / s, s = max |x| /
448, then s's float32 bytes."""

import subprocess
import sys

import numpy as np
import pytest

from app.flags import kv_cache_type
from cuda_harness import CpuLauncher, Poisoned, as_float, storage
from model.backend import check_kv_cache
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.ops.cuda_ops import CudaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from test_kernels import assert_close, launcher, rounded  # noqa: F401 (launcher: the harness, and CuPy on a GPU)
from test_model import Blocks, rel_err
from tiny_model import make_tiny_model

NUMPY = NumpyOps()
DTYPES = ["float32", "float16", "bfloat16"]
LAUNCHER = CpuLauncher()


def e4m3_values() -> np.ndarray:
    """Each of the 256 codes' value by the OCP definition (bias 7, subnormals m 2^-9; S.1111.111 NaN)."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 15, (codes & 7).astype(np.float64)
    magnitude = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7.0))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7f) == 0x7f] = np.nan
    return values.astype(np.float32)


E4M3 = e4m3_values()
POSITIVE = E4M3[:0x7f].astype(np.float64)  # codes 0 .. 0x7e, ascending


def e4m3(x) -> np.ndarray:
    """float32 -> e4m3 codes: to nearest even on the format's grid (2^-9 below 2^-6), saturated
    at 448; NaN is 0x7f, and the sign is kept (-0 is 0x80)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    _, ex = np.frexp(a)
    quantum = np.where(a >= 2.0 ** -6, np.ldexp(1.0, ex - 4), 2.0 ** -9)
    with np.errstate(invalid="ignore"):
        q = np.minimum(np.rint(a / quantum) * quantum, 448.0)
    codes = np.searchsorted(POSITIVE, np.nan_to_num(q)).astype(np.uint8)
    assert np.array_equal(POSITIVE[codes][~np.isnan(x)], q[~np.isnan(x)])
    codes |= np.signbit(x).astype(np.uint8) << 7
    codes[np.isnan(x)] = 0x7f
    return codes


def quantized(x) -> np.ndarray:
    """Rows of x (..., dim) as the cache holds them: (..., dim + 4) uint8, the codes of x / s then s,
    s = max |x| / 448 in float32 (NaN skipped by the max; s = 0: x itself, zeros)."""
    x = np.asarray(x, np.float32)
    s = (np.fmax.reduce(np.abs(x), axis=-1, initial=0.0) / np.float32(448)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s[..., None] > 0, x / s[..., None], x)
    return np.concatenate([e4m3(y), s[..., None].view(np.uint8)], axis=-1)


def dequantized(cache) -> np.ndarray:
    """An fp8 cache's rows as float32 values: each code's value times its row's scale."""
    dim = cache.shape[-1] - 4
    with np.errstate(invalid="ignore"):  # an infinite scale (a row that held an infinity)
        return E4M3[cache[..., :dim]] * np.ascontiguousarray(cache[..., dim:]).view(np.float32)


def fp8_ops(dtype: str, on=LAUNCHER) -> CudaOps:
    """CudaOps with an fp8 cache on the harness, or on `on` (test_kernels' launcher fixture: the
    harness, and CuPy on a GPU, where the conversions must give the same bits)."""
    return CudaOps(Poisoned(), on, dtype, kv="fp8")


def test_the_reference_round_trips_every_code():
    finite = ~np.isnan(E4M3)
    assert np.array_equal(e4m3(E4M3[finite]), np.arange(256)[finite])
    assert E4M3[0x7e] == 448 and E4M3[0x01] == 2.0 ** -9 and E4M3[0x08] == 2.0 ** -6 and E4M3[0x80] == 0


def edge_floats(rng) -> np.ndarray:
    """Every value, the midpoints between neighbours (ties to even) and a float32 ulp either side
    of them, float32 subnormals, random magnitudes from 2^-20 to 448 of either sign, and NaN."""
    grid = POSITIVE
    mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    near = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    tiny = np.array([1e-45, 1e-40, 2.0 ** -126, 2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 447.99], np.float32)
    random = np.exp2(rng.uniform(-20, np.log2(448), 2000)).astype(np.float32)
    values = np.concatenate([grid.astype(np.float32), near, tiny, random])
    values = np.concatenate([values, -values, [np.nan, -np.nan, -0.0]]).astype(np.float32)
    return np.clip(values, -448, 448)  # the rows' scale stays 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_write_converts_every_value_to_nearest_even(launcher, dtype):
    """Rows whose largest value is 448 have scale 1: the codes are the conversion of the values
    themselves (as the storage type holds them), bit for bit."""
    rng = np.random.default_rng(1)
    values = rounded(edge_floats(rng), dtype) if dtype != "float32" else edge_floats(rng)
    dim, kv_heads = 64, 2
    per_row = dim - 1
    rows = -(-values.size // per_row)
    padded = np.concatenate([values, np.zeros(rows * per_row - values.size, np.float32)]).reshape(rows, per_row)
    x = np.concatenate([np.full((rows, 1), 448, np.float32), padded], axis=1)
    tokens = -(-rows // kv_heads)
    x = np.concatenate([x, np.zeros((tokens * kv_heads - rows, dim), np.float32)]).reshape(tokens, kv_heads, dim)
    caches = [np.zeros((kv_heads, 1, tokens, dim + 4), np.uint8) for _ in range(2)]
    fp8_ops(dtype, launcher).write_kv(*caches, np.arange(tokens), storage(x, dtype), storage(-x, dtype))
    k = caches[0][:, 0].transpose(1, 0, 2)
    assert np.array_equal(k, quantized(as_float(storage(x, dtype), dtype)))
    assert (k[..., dim:].view(np.float32) == 1).all()
    assert np.array_equal(k[..., :dim], e4m3(as_float(storage(x, dtype), dtype)))
    assert np.array_equal(caches[1][..., :dim] ^ caches[0][..., :dim],
                          np.where((caches[0][..., :dim] & 0x7f) == 0x7f, 0, 0x80))  # -x: the sign bit alone


def test_past_448_saturates_nan_stays_nan_and_an_infinity_poisons_its_row(launcher):
    """Where x / s rounds past 448 in float32 the code is 0x7e, not NaN; a NaN is skipped by the
    max and stored as 0x7f; an infinity makes the scale infinite, and its row reads as NaN."""
    rng = np.random.default_rng(2)
    tops = rng.uniform(1, 1000, 20000).astype(np.float32)
    over = tops[tops / (tops / np.float32(448)).astype(np.float32) > 448][:4]
    assert over.size == 4
    x = rng.standard_normal((6, 1, 32)).astype(np.float32)
    x[:4, 0, 0] = over
    x[4, 0, 3] = np.nan
    x[5, 0, 7] = np.inf
    caches = [np.zeros((1, 1, 6, 36), np.uint8) for _ in range(2)]
    fp8_ops("float32", launcher).write_kv(*caches, np.arange(6), x, x)
    k = caches[0][0, 0]
    assert np.array_equal(k, quantized(x[:, 0])) and (k[:4, 0] == 0x7e).all() and k[4, 3] == 0x7f
    assert np.isnan(dequantized(k[5])).all() and not np.isnan(dequantized(k[:5])[:4]).any()


@pytest.mark.parametrize("path", ["decode", "prefill", "prefill_tc"])
def test_the_kernels_read_every_code(launcher, path):
    """One key with scale 1: the output is the value row itself, each of the 256 codes widened
    exactly (NaN codes NaN); float16 holds every e4m3 value, float32 too."""
    dtype = "float16" if path == "prefill_tc" else "float32"
    ops, kv_heads, dim = fp8_ops(dtype, launcher), 4, 64
    cache_k = np.zeros((kv_heads, 2, 16, dim + 4), np.uint8)  # K zero: every score 0
    cache_v = np.zeros_like(cache_k)
    cache_v[:, 1, 0, :dim] = np.arange(256, dtype=np.uint8).reshape(kv_heads, dim)
    cache_v[:, 1, :, dim:] = np.frombuffer(np.float32(1).tobytes(), np.uint8)
    ops.tensor_cores = path == "prefill_tc"
    lens = [1] if path == "decode" else [2]
    q = storage(np.ones((lens[0], kv_heads, dim)), dtype)
    out = ops.paged_attention(q, cache_k, cache_v, ops.attention_meta(lens, lens, [[1]], 16), 0.125)
    got = as_float(out.reshape(lens[0], kv_heads * dim)[0], dtype)
    np.testing.assert_array_equal(got, E4M3)


def scattered(rng, context_lens, kv_heads, dim, block_size=16, spread=1.0):
    """Float K/V for sequences of context_lens, each sequence's blocks scattered over a pool, in
    NumPy's cache layout, with their slots; rows of very different sizes (scales)."""
    blocks = -(-np.asarray(context_lens) // block_size)
    num_blocks = int(blocks.sum()) + 3
    ids = rng.permutation(num_blocks)
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at:at + n].tolist())
        at += n
    shape = (kv_heads, num_blocks, block_size, dim)
    sizes = np.exp(rng.uniform(-spread, spread, (kv_heads, num_blocks, block_size, 1)))
    return (rng.standard_normal(shape) * sizes).astype(np.float32), (rng.standard_normal(shape) * sizes).astype(
        np.float32), tables


def fp8_caches(ops, k, v, dtype):
    """The fp8 caches of float caches k and v (NumPy's layout), written by the kernel."""
    kv_heads, blocks, block_size, dim = k.shape
    caches = [np.zeros((kv_heads, blocks, block_size, dim + 4), np.uint8) for _ in range(2)]
    tokens = lambda c: storage(c.transpose(1, 2, 0, 3).reshape(blocks * block_size, kv_heads, dim), dtype)  # noqa: E731
    ops.write_kv(*caches, np.arange(blocks * block_size), tokens(k), tokens(v))
    return caches


def test_the_write_matches_the_quantizer_bit_for_bit_through_the_slots(launcher):
    rng = np.random.default_rng(3)
    for dtype in DTYPES:
        k, v = (rng.standard_normal((9, 3, 40)).astype(np.float32) * 5 for _ in range(2))
        k[2, 1] = 0  # an all-zero row: scale 0, zeros
        slots = np.array([5, 0, 17, -1, 30, 8, 9, 2, 31])  # -1: padding, written nowhere
        caches = [np.full((3, 2, 16, 44), 0xa5, np.uint8) for _ in range(2)]
        fp8_ops(dtype, launcher).write_kv(*caches, slots, storage(k, dtype), storage(v, dtype))
        for cache, x in zip(caches, (k, v)):
            want = np.full_like(cache, 0xa5).reshape(3, 32, 44)
            keep = slots >= 0
            want[:, slots[keep]] = quantized(rounded(x, dtype)[keep]).transpose(1, 0, 2)
            assert np.array_equal(cache.reshape(3, 32, 44), want), dtype
        assert not caches[0].reshape(3, 32, 44)[1, 17, :40].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,norm", [(8, 2, 64, None), (6, 3, 96, None), (4, 2, 32, None),
                                                     (4, 1, 256, "head"), (6, 3, 128, "whole")])
def test_rope_and_cache_quantizes_what_the_float_cache_holds(launcher, dtype, heads, kv_heads, dim, norm):
    """The fused rotation's fp8 write is the float one's cache quantized, its q the same bits;
    with norms too (q, k and v per head as Gemma 4's, q and k over the whole projection as OLMoE's)."""
    rng = np.random.default_rng(dim)
    tokens = 7
    qkv = storage(rng.standard_normal((tokens, (heads + 2 * kv_heads) * dim)) * 3, dtype)
    angles = rng.uniform(0, 6, (tokens, dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    slots = np.array([3, 1, -1, 0, 6, 5, 2])
    widths = {None: (), "head": (dim, dim, dim), "whole": (heads * dim, kv_heads * dim)}[norm]
    norms = dict(zip(("q_norm", "k_norm", "v_norm"), (storage(rng.uniform(0.5, 1.5, n), dtype) for n in widths)))
    plain = CudaOps(Poisoned(), launcher, dtype)
    float_caches = [np.zeros((kv_heads, 1, 8, dim), plain.storage_dtype) for _ in range(2)]
    fp8 = [np.full((kv_heads, 1, 8, dim + 4), 0x5a, np.uint8) for _ in range(2)]
    q_plain = plain.rope_and_cache(qkv, cos, sin, *float_caches, slots, heads, **norms, eps=1e-6)
    q_fp8 = fp8_ops(dtype, launcher).rope_and_cache(qkv, cos, sin, *fp8, slots, heads, **norms, eps=1e-6)
    assert np.array_equal(q_plain, q_fp8)
    written = [3, 1, 0, 6, 5, 2]
    for f, c in zip(float_caches, fp8):
        assert np.array_equal(c[:, 0, written], quantized(as_float(f[:, 0, written], dtype)))
        assert (c[:, 0, 4] == 0x5a).all() and (c[:, 0, 7] == 0x5a).all()


def attend(ops, q, caches, query_lens, context_lens, tables, **kw):
    meta = ops.attention_meta(query_lens, context_lens, tables, 16)
    return ops.paged_attention(q, *caches, meta, q.shape[-1] ** -0.5, **kw)


def reference(q, k, v, query_lens, context_lens, tables, **kw):
    meta = NUMPY.attention_meta(query_lens, context_lens, tables, 16)
    return NUMPY.paged_attention(q, k, v, meta, q.shape[-1] ** -0.5, **kw)


# decode (every row one token, the context split where long), prefill on CUDA cores and on tensor cores
@pytest.mark.parametrize("path,dtype", [("decode", d) for d in DTYPES] + [("prefill", d) for d in DTYPES] + [
    ("prefill_tc", "float16"), ("prefill_tc", "bfloat16")])
@pytest.mark.parametrize("heads,kv_heads,dim,window,softcap", [
    (8, 2, 64, 0, 0.0), (9, 3, 96, 0, 0.0), (16, 1, 32, 0, 0.0), (8, 1, 256, 0, 0.0), (8, 2, 64, 40, 2.5)])
def test_attention_on_fp8_matches_numpy_on_the_same_values(launcher, path, dtype, heads, kv_heads, dim, window,
                                                           softcap):
    if path == "prefill_tc" and dim % 16:
        pytest.skip("the tensor-core kernel takes a head_dim in tiles of 16")
    rng = np.random.default_rng(heads * dim + window)
    ops = fp8_ops(dtype, launcher)
    ops.tensor_cores = path == "prefill_tc"
    context_lens = [300, 33, 16, 70] if path == "decode" else [37, 48, 21, 52]
    query_lens = [1] * 4 if path == "decode" else [37, 16, 5, 20]
    k, v, tables = scattered(rng, context_lens, kv_heads, dim)
    caches = fp8_caches(ops, k, v, dtype)
    q = rng.standard_normal((sum(query_lens), heads, dim)).astype(np.float32)
    got = attend(ops, storage(q, dtype), caches, query_lens, context_lens, tables, window=window, softcap=softcap)
    same_k, same_v = (dequantized(c) for c in caches)
    if path == "prefill_tc":  # the tensor cores take K and V rounded to the storage type
        same_k, same_v = rounded(same_k, dtype), rounded(same_v, dtype)
    kw = dict(window=window, softcap=softcap)
    # rows up to e times as large as the standard normal's: the floor is the values' scale
    assert_close(got, reference(rounded(q, dtype), same_k, same_v, query_lens, context_lens, tables, **kw), dtype,
                 floor=3.0)
    exact = reference(rounded(q, dtype), rounded(k, dtype), rounded(v, dtype), query_lens, context_lens, tables, **kw)
    assert rel_err(as_float(got, dtype), exact) < 0.1, rel_err(as_float(got, dtype), exact)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_output_is_the_same_bits_alone_in_a_batch_and_however_chunked(launcher, dtype):
    rng = np.random.default_rng(9)
    heads, kv_heads, dim, n = 8, 2, 64, 150
    ops = fp8_ops(dtype, launcher)
    k, v, tables = scattered(rng, [n, 90, 40], kv_heads, dim)
    caches = fp8_caches(ops, k, v, dtype)
    q = storage(rng.standard_normal((n, heads, dim)), dtype)
    for kw in ({}, {"window": 50}):
        whole = attend(ops, q, caches, [n], [n], tables[:1], **kw)
        cuts = [2, 9, 16, 40, 42, 100, 131]  # chunks of 2 tokens and up: prefill's kernel throughout
        for lo, hi in zip([0] + cuts, cuts + [n]):
            assert np.array_equal(attend(ops, q[lo:hi], caches, [hi - lo], [hi], tables[:1], **kw),
                                  whole[lo:hi]), (lo, hi)
        others = storage(rng.standard_normal((1 + 40, heads, dim)), dtype)
        beside = attend(ops, np.concatenate([others[:1], q[100:150], others[1:]]), caches, [1, 50, 40],
                        [90, 150, 40], [tables[1], tables[0], tables[2]], **kw)
        assert np.array_equal(beside[1:51], whole[100:150])
        alone = attend(ops, q[149:150], caches, [1], [150], tables[:1], **kw)  # decode: its own kernel
        batch = attend(ops, np.concatenate([others[:1], q[149:150], others[1:2]]), caches, [1, 1, 1],
                       [90, 150, 40], [tables[1], tables[0], tables[2]], **kw)
        assert np.array_equal(batch[1], alone[0])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-fp8-kv"), hidden=128, heads=4, kv_heads=2)


# fp8 K/V's logits against float16 K/V's, relative to the largest logit, measured over the three
# steps (2026-12-07, the harness): 2.6e-2 to 4.3e-2 in float16, 2.9e-2 to 4.9e-2 in bfloat16
# (bfloat16 K/V alone: 0.9e-2 to 1.2e-2); e4m3 keeps 3 mantissa bits, about 3% a value, and this
# random model's attention has no structure to average it out. The bounds are about 2.5x those.
FORWARD_TOLERANCE = {"float16": 0.1, "bfloat16": 0.12}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tiny_models_forward_pass_with_fp8_k_v_is_close_to_float16_k_v(tiny_dir, dtype):
    runners = [ModelRunner.from_dir(tiny_dir, num_blocks=64, ops=CudaOps(np, CpuLauncher(), "float16")),
               ModelRunner.from_dir(tiny_dir, num_blocks=64, ops=CudaOps(np, CpuLauncher(), dtype, kv="fp8"))]
    assert runners[1].cache.k[0].dtype == np.uint8 and runners[1].cache.k[0].shape[-1] == 32 + 4
    blocks = Blocks(runners[0])
    rng = np.random.default_rng(0)
    prompts = {"a": rng.integers(3, 390, 37).tolist(), "b": rng.integers(3, 390, 20).tolist(),
               "c": rng.integers(3, 390, 50).tolist()}
    steps = [[("a", prompts["a"], 0), ("b", prompts["b"], 0), ("c", prompts["c"][:24], 0)],
             [("a", [7], 37), ("b", [8], 20), ("c", prompts["c"][24:], 24)],
             [("a", [9], 38), ("b", [10], 21), ("c", [11], 50)]]
    for rows in steps:
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        want, got = (r.ops.to_host(r.logits(plan)) for r in runners)
        assert rel_err(got, want) < FORWARD_TOLERANCE[dtype], rel_err(got, want)


def test_blocks_spill_and_reload_under_other_ids_byte_for_byte(tiny_dir):
    config = ModelConfig.load(tiny_dir)
    ops = fp8_ops("bfloat16")
    cache = KVCache(ops, config, num_blocks=12, block_size=16)
    per_block = sum(k[:, 0].nbytes + v[:, 0].nbytes for k, v in cache.kv_layers)
    assert KVCache.bytes_per_block_of(ops, config, 16) == per_block
    assert per_block == 2 * 2 * config.num_kv_heads * 16 * (config.head_dim + 4)  # 2 layers, K and V
    rng = np.random.default_rng(4)
    table, other = [3, 7], [0, 11]
    for k_cache, v_cache in cache.kv_layers:
        k, v = (storage(rng.standard_normal((30, config.num_kv_heads, config.head_dim)), "bfloat16") for _ in range(2))
        ops.write_kv(k_cache, v_cache, cache.slots(table, 0, 30), k, v)
    saved = cache.save_blocks(table)
    assert saved.dtype == np.uint8 and saved.nbytes == 2 * per_block
    cache.load_blocks(other, saved)
    for part, _ in cache.block_parts():
        assert np.array_equal(part[:, other], part[:, table])
    q = storage(rng.standard_normal((30, config.num_heads, config.head_dim)), "bfloat16")
    outs = [attend(ops, q, cache.kv_layers[0], [30], [30], [t]) for t in (table, other)]
    assert np.array_equal(outs[0], outs[1])


def test_tokens_per_gib_against_bfloat16():
    """The arithmetic of bytes_per_block: (head_dim + 4) bytes a token and head against 2 head_dim."""
    for dim, ratio in ((64, 128 / 68), (128, 256 / 132)):
        config = ModelConfig.from_dict(dict(model_type="llama", hidden_size=dim * 8, num_attention_heads=8,
                                            num_key_value_heads=2, num_hidden_layers=4, head_dim=dim,
                                            intermediate_size=64, vocab_size=100))
        bf16 = KVCache.bytes_per_block(config, 16, 2)
        fp8 = KVCache.bytes_per_block_of(fp8_ops("bfloat16"), config, 16)
        assert bf16 / fp8 == pytest.approx(ratio)


def refusal(*argv: str) -> str:
    """What `spool serve ARGV` refuses with, in-process: the flags' check serve runs before it
    listens."""
    from app import cli
    from app.serve import validate_flags

    _, args, _ = cli.parse(["serve", *argv])
    try:
        validate_flags(args)
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("argv, says", [
    (["--kv-cache-dtype", "fp8_e4m3", "--backend", "numpy"], "--kv-cache-dtype fp8_e4m3 is --backend cuda's"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2 is not built"),
    (["--kv-cache-dtype", "fp8", "-ctk", "q8_0", "-ctv", "q8_0"], "--kv-cache-dtype fp8 with --cache-type-k q8_0"),
    (["-ctk", "fp8", "-ctv", "fp8"], "--cache-type-k fp8 is not built"),
    (["-ctk", "q8_0", "-ctv", "q8_0", "--backend", "cuda"], "a q8_0 K/V cache is the CPU backend's"),
])
def test_what_cannot_work_is_refused(argv, says):
    assert refusal(*argv).startswith(says)


def test_auto_is_resolved_before_the_server_listens():
    """--backend auto with a cache type only one backend keeps: refused before "listening" where
    auto would pick the other."""
    from model.backend import cuda_available

    fp8, q8_0 = refusal("--kv-cache-dtype", "fp8"), refusal("-ctk", "q8_0", "-ctv", "q8_0")
    assert (fp8 == "accepted") == cuda_available() and (q8_0 == "accepted") != cuda_available()
    assert fp8 == "accepted" or fp8.startswith("an fp8 K/V cache (--kv-cache-dtype fp8) is --backend cuda's, not cpu's")


def test_the_command_line_refuses_in_one_line():
    done = subprocess.run([sys.executable, "-m", "app", "serve", "--kv-cache-dtype", "fp8", "--backend", "cpu"],
                          capture_output=True, text=True, timeout=120)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line == ("error: --kv-cache-dtype fp8 is --backend cuda's; on the CPU,"
                                             " --cache-type-k q8_0 --cache-type-v q8_0 quantizes K/V"), done.stderr


def test_fp8_is_accepted_for_cuda():
    from argparse import Namespace

    for name in ("fp8", "fp8_e4m3"):
        args = Namespace(kv_cache_dtype=name, cache_type_k="f16", cache_type_v="f16", backend="cuda")
        assert kv_cache_type(args) == "fp8"
        check_kv_cache("cuda", "bfloat16", "fp8")
    with pytest.raises(ValueError, match="is --backend cuda's"):
        check_kv_cache("cpu", "auto", "fp8")


def test_the_memory_plan_sizes_fp8_blocks_and_the_start_line_names_them(tiny_dir):
    """gpu_kv_blocks on the harness: the same budget holds about 1.8 times the bfloat16 blocks
    (head_dim 32: 36 bytes a token and head against 64); kv_type names the cache fp8_e4m3."""
    from app.serve import kv_type
    from model.backend import Backend
    from model.memory import GIB, plan_kv_cache
    from model.runner import load_model

    plans = {}
    for kv in ("f16", "fp8"):
        model = load_model(tiny_dir, CudaOps(np, CpuLauncher(memory=(GIB // 2, GIB)), "bfloat16", kv=kv))
        plans[kv] = plan_kv_cache(model, 0.9, max_seqs=4, max_batched_tokens=32, max_model_len=64)
        assert plans[kv].block_bytes == KVCache.bytes_per_block_of(model.ops, model.config)
        assert kv_type(Backend("cuda", "bfloat16", model.ops, kv=kv)) == ("fp8_e4m3" if kv == "fp8" else "bfloat16")
    assert plans["f16"].block_bytes / plans["fp8"].block_bytes == pytest.approx(64 / 36)
    assert plans["fp8"].num_blocks > 1.7 * plans["f16"].num_blocks


def test_the_perplexity_tools_simulation_rounds_as_the_kernel_writes():
    """tools/perplexity.py --simulate-kv fp8_e4m3 (the perplexity cost's measurement) keeps what
    the kernel's fp8 cache reads back as, bit for bit."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from perplexity import simulated

    rng = np.random.default_rng(6)
    k, v = (rng.standard_normal((8, 2, 32)).astype(np.float32) * np.exp2(rng.uniform(-8, 8, (8, 2, 1))).astype(
        np.float32) for _ in range(2))
    k[3, 1] = 0
    fp8 = [np.zeros((2, 1, 8, 36), np.uint8) for _ in range(2)]
    fp8_ops("float32").write_kv(*fp8, np.arange(8), k, v)
    sim = [np.zeros((2, 1, 8, 32), np.float32) for _ in range(2)]
    simulated("fp8_e4m3").write_kv(*sim, np.arange(8), k, v)
    for f, s in zip(fp8, sim):
        assert np.array_equal(dequantized(f), s)


def test_replayed_decode_graphs_on_an_fp8_cache_give_the_eager_logits(tiny_dir):
    """Decode steps replayed from captured graphs (the harness's stand-in) on an fp8 cache give
    the eager step's logits (to 1e-5, as tests/test_cuda_graphs.py: a padded batch's GEMMs may
    round otherwise), and padding rows write no K/V: the caches agree but for a rare code that the
    GEMMs' last bit moved across a rounding boundary."""
    graphed, eager = (ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4,
                                           ops=CudaOps(np, CpuLauncher(), "bfloat16", kv="fp8")) for _ in range(2))
    graphed.capture_graphs(4, 64)
    blocks = Blocks(eager)
    rng = np.random.default_rng(8)
    prompts = {rid: rng.integers(3, 390, int(n)).tolist() for rid, n in zip("abc", rng.integers(5, 30, 3))}
    position = {rid: len(p) for rid, p in prompts.items()}

    def step(rows):
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        before = graphed.graphs.replays
        got, want = (r.ops.to_host(r.logits(plan)) for r in (graphed, eager))
        assert rel_err(got, want) < 1e-5, rel_err(got, want)
        return graphed.graphs.replays - before

    assert step([(rid, p, 0) for rid, p in prompts.items()]) == 0
    for rids in ["abc", "a", "bc"]:  # 3 rows pad to 4; 1; 2
        assert step([(rid, [int(rng.integers(3, 390))], position[rid]) for rid in rids]) == 1
        for rid in rids:
            position[rid] += 1
    for ours, theirs in zip(graphed.cache.k + graphed.cache.v, eager.cache.k + eager.cache.v):
        assert ours.dtype == np.uint8 and np.count_nonzero(ours != theirs) <= 4, np.count_nonzero(ours != theirs)
