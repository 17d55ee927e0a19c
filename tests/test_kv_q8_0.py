"""The q8_0 K/V cache (--cache-type-k q8_0 --cache-type-v q8_0 on the CPU): its write against a
NumPy quantizer, the attention kernel on it against NumPy's attention over the same values
dequantized (tight) and over the float32 K/V (loose: the rounding's cost), a token's output the
same bits in any chunk or company, blocks that spill and reload byte for byte, and the server
serving with it and refusing what cannot work in one line."""

import subprocess
import sys

import httpx
import numpy as np
import pytest

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.memory import GIB
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from tiny_model import make_tiny_model

NUMPY = NumpyOps()
Q8 = NumbaOps("q8_0", kv="q8_0")
SCALE = 0.125


def quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales) of rows of x, as q8_0 keeps them: round(x / s), s = max |x| / 127."""
    s = (np.abs(x).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1))[..., None]
    return np.rint(x / safe).astype(np.int8), s


def dequantized(cache_k: np.ndarray, cache_v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 caches as NumPy's float32 ones (kv_heads, blocks, block_size, head_dim), read from the
    bytes by the layout alone: a K block head-dim-major then its keys' scales, V rows each
    followed by its scale."""
    heads, blocks, size, width = cache_k.shape
    dim = width - 4
    flat = cache_k.reshape(heads, blocks, -1)
    k_values = flat[..., :dim * size].reshape(heads, blocks, dim, size).transpose(0, 1, 3, 2)
    k_scales = flat[..., dim * size:].copy().view(np.float32)
    v_values, v_scales = cache_v[..., :dim], cache_v[..., dim:].copy().view(np.float32)
    return k_values * k_scales[..., None], v_values * v_scales


class Cache:
    """One layer's q8_0 K/V for some rows, each row's blocks scattered through the cache, and the
    float32 K/V it was written from in NumPy's layout."""

    def __init__(self, rng, context_lens, kv_heads, dim, block_size):
        self.block_size = block_size
        blocks = sum(-(-c // block_size) for c in context_lens) + 3
        free = list(rng.permutation(blocks))
        self.tables = [[int(free.pop()) for _ in range(-(-c // block_size))] for c in context_lens]
        self.exact = [np.zeros((kv_heads, blocks, block_size, dim), np.float32) for _ in range(2)]
        self.q8 = [np.zeros((kv_heads, blocks, block_size, dim + 4), np.int8) for _ in range(2)]
        for table, n in zip(self.tables, context_lens):
            k, v = (rng.standard_normal((n, kv_heads, dim), dtype=np.float32) * 2 for _ in range(2))
            slots = np.array([table[p // block_size] * block_size + p % block_size for p in range(n)])
            NUMPY.write_kv(*self.exact, slots, k, v)
            Q8.write_kv(*self.q8, slots, k, v)

    def attend(self, ops, q, query_lens, context_lens, tables=None, caches=None, **kw):
        meta = ops.attention_meta(query_lens, context_lens, tables or self.tables, self.block_size)
        return ops.paged_attention(q, *(caches or self.q8), meta, SCALE, **kw)


def test_the_write_stores_each_token_and_heads_values_and_scale():
    rng = np.random.default_rng(0)
    cache = Cache(rng, [40], 2, 64, 16)
    k, v = (x[:, cache.tables[0]].reshape(2, -1, 64)[:, :40] for x in cache.exact)
    got_k, got_v = (x[:, cache.tables[0]].reshape(2, -1, 64)[:, :40] for x in dequantized(*cache.q8))
    for exact, got in ((k, got_k), (v, got_v)):
        values, scales = quantized(exact)
        np.testing.assert_array_equal(got, values * scales[..., None])
        assert np.abs(got - exact).max() <= scales.max() / 2 * 1.0001
    zero = [np.zeros((1, 1, 4, 20), np.int8) for _ in range(2)]
    Q8.write_kv(*zero, np.array([2]), np.zeros((1, 1, 16), np.float32), np.zeros((1, 1, 16), np.float32))
    assert not any(z.any() for z in zero)  # a zero vector: zero values and a zero scale, never NaN


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 64), (8, 2, 64), (16, 2, 128), (8, 1, 80)])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("block_size", [16, 4, 32])
def test_attention_on_q8_0_matches_numpy_on_the_same_values(heads, kv_heads, dim, window, block_size):
    """Decode rows beside a whole prompt and prompt chunks on cached prefixes, many blocks of
    context: tight against the values the cache holds, loose against the float32 K/V."""
    rng = np.random.default_rng(heads + dim + window + block_size)
    query_lens, context_lens = [1, 150, 1, 37, 70], [300, 150, 16, 53, 211]
    cache = Cache(rng, context_lens, kv_heads, dim, block_size)
    q = rng.standard_normal((sum(query_lens), heads, dim), dtype=np.float32)
    got = cache.attend(Q8, q, query_lens, context_lens, window=window)
    same = cache.attend(NUMPY, q, query_lens, context_lens, caches=dequantized(*cache.q8), window=window)
    np.testing.assert_allclose(got, same, rtol=1e-4, atol=2e-5)
    exact = cache.attend(NUMPY, q, query_lens, context_lens, caches=cache.exact, window=window)
    error = np.abs(got - exact)
    assert error.max() < 0.2 and error.mean() < 0.015, (error.max(), error.mean())  # K/V of about 2: a step of 0.05
    assert np.abs(same - exact).max() > 1e-4  # the rounding is there to see


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_token_is_the_same_bits_in_any_chunk_or_company(block_size):
    rng = np.random.default_rng(block_size)
    heads, kv_heads, dim, n = 12, 3, 64, 300
    cache = Cache(rng, [n, 90, 40], kv_heads, dim, block_size)
    q = rng.standard_normal((n, heads, dim), dtype=np.float32)
    for kw in ({}, {"window": 50}):
        whole = cache.attend(Q8, q, [n], [n], cache.tables[:1], **kw)
        cuts = np.sort(rng.choice(np.arange(1, n), size=12, replace=False)).tolist()
        for lo, hi in zip([0] + cuts, cuts + [n]):
            np.testing.assert_array_equal(cache.attend(Q8, q[lo:hi], [hi - lo], [hi], cache.tables[:1], **kw),
                                          whole[lo:hi])
        for t in (0, 15, 16, 17, 151, 299):
            np.testing.assert_array_equal(cache.attend(Q8, q[t:t + 1], [1], [t + 1], cache.tables[:1], **kw),
                                          whole[t:t + 1])
        others = rng.standard_normal((1 + 40, heads, dim), dtype=np.float32)
        beside = cache.attend(Q8, np.concatenate([others[:1], q[100:250], others[1:]]), [1, 150, 40],
                              [90, 250, 40], [cache.tables[1], cache.tables[0], cache.tables[2]], **kw)
        np.testing.assert_array_equal(beside[1:151], whole[100:250])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-q8-kv"), hidden=128, heads=4, kv_heads=2)


def test_a_models_logits_are_the_same_bits_alone_beside_others_and_however_chunked(tiny_dir):
    runner = ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=NumbaOps("q8_0", kv="q8_0"))
    assert runner.cache.k[0].dtype == np.int8
    rng = np.random.default_rng(3)
    prompt, other = rng.integers(0, runner.config.vocab_size, 45).tolist(), [5, 6, 7, 8, 9]
    whole = np.asarray(runner.logits(StepPlan([Row("a", prompt, 0, list(range(12)), sample=True)])))[0]
    chunked = [np.asarray(runner.logits(StepPlan([Row("b", prompt[lo:hi], lo, list(range(12, 24)),
                                                      sample=True)])))[0]
               for lo, hi in ((0, 7), (7, 30), (30, 45))][-1]
    beside = np.asarray(runner.logits(StepPlan([Row("o", other, 0, list(range(24, 26)), sample=True),
                                                Row("c", prompt, 0, list(range(26, 38)), sample=True)])))[1]
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(beside, whole)


def test_blocks_spill_and_reload_under_other_ids_byte_for_byte(tiny_dir):
    config = ModelConfig.load(tiny_dir)
    cache = KVCache(Q8, config, num_blocks=12, block_size=4)
    per_block = sum(k[:, 0].nbytes + v[:, 0].nbytes for k, v in cache.kv_layers)
    assert KVCache.bytes_per_block_of(Q8, config, 4) == per_block
    assert per_block == 2 * 2 * config.num_kv_heads * 4 * (config.head_dim + 4)  # 2 layers, K and V, 1 byte + scale
    rng = np.random.default_rng(4)
    for k_cache, v_cache in cache.kv_layers:
        k, v = (rng.standard_normal((14, config.num_kv_heads, config.head_dim), dtype=np.float32) for _ in range(2))
        Q8.write_kv(k_cache, v_cache, cache.slots([3, 7, 1, 9], 0, 14), k, v)
    saved = cache.save_blocks([3, 7, 1, 9])
    assert saved.dtype == np.int8 and saved.nbytes == 4 * per_block
    cache.load_blocks([0, 2, 5, 11], saved)
    for part, _ in cache.block_parts():
        np.testing.assert_array_equal(part[:, [0, 2, 5, 11]], part[:, [3, 7, 1, 9]])
    q = rng.standard_normal((14, config.num_heads, config.head_dim), dtype=np.float32)
    (k_cache, v_cache), outs = cache.kv_layers[0], []
    for table in ([3, 7, 1, 9], [0, 2, 5, 11]):
        outs.append(Q8.paged_attention(q, k_cache, v_cache, Q8.attention_meta([14], [14], [table], 4), SCALE))
    np.testing.assert_array_equal(outs[0], outs[1])


def spool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, says", [
    (["--cache-type-k", "q8_0"], "--cache-type-k q8_0 with --cache-type-v f16: K and V are kept alike"),
    (["-ctk", "q4_0", "-ctv", "q4_0"], "--cache-type-k q4_0 is not built; K/V is f16, q8_0 on the CPU"),
    (["--kv-cache-dtype", "fp8", "--backend", "cpu"], "--kv-cache-dtype fp8 is --backend cuda's"),
    (["-ctk", "q8_0", "-ctv", "q8_0", "--backend", "numpy"], "a q8_0 K/V cache is the CPU backend's"),
    (["-ctk", "q8_0", "-ctv", "q8_0", "--dtype", "float32"], "a q8_0 K/V cache is the CPU backend's"),
])
def test_what_cannot_work_is_refused_in_one_line(argv, says):
    done = spool("serve", *argv)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith(f"error: {says}"), done.stderr
    if "fp8" in argv:
        assert "--cache-type-k q8_0" in line


def test_the_server_serves_with_q8_0_k_v_and_holds_more_tokens(tiny_dir):
    from live_server import LiveServer

    server = LiveServer(str(tiny_dir), "--backend", "cpu", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0",
                        "--kv-cache-gib", "0.01", "--max-model-len", "256")
    try:
        server.assert_serving()
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["vllm_config"]["cache_config"]["cache_dtype"] == "q8_0"
        config = ModelConfig.load(tiny_dir)
        blocks = int(0.01 * GIB // KVCache.bytes_per_block(config, 16, 1, q8_0=True))
        assert info["max_total_tokens"] == blocks * 16
        f16 = int(0.01 * GIB // KVCache.bytes_per_block(config, 16, 2))
        assert config.head_dim == 32 and blocks > 1.75 * f16  # a head vector in 36 bytes, not 64
        assert f"KV cache {blocks} blocks x 16 tokens of q8_0 K/V" in server.output()
    finally:
        assert server.stop() == 0, server.output()
