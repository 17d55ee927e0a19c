"""Every numba kernel against its NumPy twin (NumpyOps, the oracle) on random
inputs at ragged shapes."""

import shutil

import numpy as np
import pytest

from model.ops.numba_kernels import HALF
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.ops.protocol import Ops, SampleBatch

NUMPY, NUMBA = NumpyOps(), NumbaOps()

RTOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_every_backend_has_every_member_of_the_ops_protocol():
    from cuda_harness import CpuLauncher
    from model.ops.cuda_ops import CudaOps

    for ops in (NUMPY, NUMBA, NumbaOps("q8_0"), CudaOps(np, CpuLauncher())):
        assert isinstance(ops, Ops), type(ops)
    assert NUMBA.storage_dtype == np.float32 and NumbaOps("q8_0").storage_dtype == HALF


@pytest.mark.parametrize("tokens, hidden", [(1, 8), (3, 576), (17, 100)])
def test_add_rms_norm_matches_numpy(rng, tokens, hidden):
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    delta = rng.standard_normal((tokens, hidden), dtype=np.float32)
    weight = rng.standard_normal(hidden, dtype=np.float32)
    want_x, want = NUMPY.add_rms_norm(x.copy(), delta, weight, 1e-5)
    got_x, got = NUMBA.add_rms_norm(x.copy(), delta, weight, 1e-5)
    np.testing.assert_allclose(got_x, want_x, **RTOL)
    np.testing.assert_allclose(got, want, **RTOL)
    _, first = NUMBA.add_rms_norm(x.copy(), None, weight, 1e-5)  # the first layer: nothing to add
    np.testing.assert_allclose(first, NUMPY.rms_norm(x, weight, 1e-5), **RTOL)


def test_rms_norm_over_heads_matches_numpy(rng):  # Qwen3's q_norm and k_norm: (tokens, heads, head_dim)
    x = rng.standard_normal((5, 3, 16), dtype=np.float32)
    weight = rng.standard_normal(16, dtype=np.float32)
    np.testing.assert_allclose(NUMBA.rms_norm(x, weight, 1e-6), NUMPY.rms_norm(x, weight, 1e-6), **RTOL)


@pytest.mark.parametrize("tokens, heads, dim", [(1, 1, 2), (7, 9, 64), (3, 2, 128)])
def test_rope_matches_numpy(rng, tokens, heads, dim):
    x = rng.standard_normal((tokens, heads, dim), dtype=np.float32)
    angles = rng.uniform(0, 100, (tokens, dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    np.testing.assert_allclose(NUMBA.rope(x, cos, sin), NUMPY.rope(x, cos, sin), **RTOL)


@pytest.mark.parametrize("tokens, width", [(1, 4), (5, 1536), (33, 7)])
def test_silu_and_mul_matches_numpy(rng, tokens, width):
    gate_up = rng.standard_normal((tokens, 2 * width), dtype=np.float32) * 4
    gate_up[0, :4] = [-200, -90, 90, 200]  # past the exponential's clamps, both ways
    with np.errstate(over="ignore"):  # NumPy's exp(200) is inf, and silu(-200) -0 all the same
        want = NUMPY.silu_and_mul(gate_up.copy())
    np.testing.assert_allclose(NUMBA.silu_and_mul(gate_up), want, **RTOL)


@pytest.mark.parametrize("query_lens, context_lens, heads, kv_heads, dim, block_size", [
    ([1], [1], 1, 1, 8, 4),  # one cached position
    ([1, 1, 1], [5, 16, 37], 9, 3, 64, 16),  # decode rows: ragged contexts, GQA groups of 3
    ([1, 6, 1, 3], [9, 6, 30, 40], 4, 2, 32, 4),  # decode rows beside prefill chunks on a cached prefix
    ([5], [5], 2, 2, 16, 16),  # prefill only
    ([1, 300], [20, 340], 6, 2, 16, 16),  # a long chunk on a cached prefix: three causal tiles
])
@pytest.mark.parametrize("half", [False, True], ids=["float32 K/V", "float16 K/V"])
def test_paged_attention_matches_numpy(rng, query_lens, context_lens, heads, kv_heads, dim, block_size, half):
    blocks = 64
    cache_k = rng.standard_normal((kv_heads, blocks, block_size, dim), dtype=np.float32)
    cache_v = rng.standard_normal((kv_heads, blocks, block_size, dim), dtype=np.float32)
    cache_k[0, :, 0, :4] = [0, -0.0, 3e-6, -6e-8]  # zeros and float16 subnormals
    if half:  # NumPy attends over the float16 values, widened; numba reads the bits
        cache_k, cache_v = (c.astype(np.float16).astype(np.float32) for c in (cache_k, cache_v))
    free = list(rng.permutation(blocks))  # each row's blocks scattered through the cache
    tables = [[int(free.pop()) for _ in range(-(-c // block_size))] for c in context_lens]
    q = rng.standard_normal((sum(query_lens), heads, dim), dtype=np.float32)
    want = NUMPY.paged_attention(q, cache_k, cache_v,
                                     NUMPY.attention_meta(query_lens, context_lens, tables, block_size), 0.125)
    cache_k = head_dim_major(cache_k)
    if half:
        cache_k, cache_v = (c.astype(np.float16).view(HALF) for c in (cache_k, cache_v))
    got = NUMBA.paged_attention(q, cache_k, cache_v,
                                    NUMBA.attention_meta(query_lens, context_lens, tables, block_size), 0.125)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def head_dim_major(cache_k: np.ndarray) -> np.ndarray:
    """NumpyOps' K cache as NumbaOps lays it out: each block's keys side by side a dimension."""
    return np.ascontiguousarray(cache_k.transpose(0, 1, 3, 2)).reshape(cache_k.shape)


@pytest.mark.parametrize("half", [False, True], ids=["float32 K/V", "float16 K/V"])
def test_write_kv_stores_what_numpy_stores(rng, half):
    """K and V as the forward pass hands them over: views into the fused qkv output."""
    qkv = rng.standard_normal((5, 8 * 3), dtype=np.float32) * 100
    k, v = qkv[:, 8:16].reshape(5, 1, 8), qkv[:, 16:].reshape(5, 1, 8)
    slots = np.array([0, 17, 33, 40, 63])
    want_k, want_v = (np.zeros((1, 4, 16, 8), dtype=np.float32) for _ in range(2))
    NUMPY.write_kv(want_k, want_v, slots, k, v)
    cache_k, cache_v = (np.zeros((1, 4, 16, 8), dtype=HALF if half else np.float32) for _ in range(2))
    NUMBA.write_kv(cache_k, cache_v, slots, k, v)
    for cache, want in ((cache_k, head_dim_major(want_k)), (cache_v, want_v)):
        got = cache.view(np.float16).astype(np.float32) if half else cache
        np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32) if half else want)


def test_the_cpu_backend_refuses_a_head_dim_it_cannot_read():
    from model.backend import check_model, resolve
    from model.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=10, hidden_size=24, intermediate_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=1e4,
                         rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
                         attention_bias=False, qk_norm=False, eos_token_ids=(2,), bos_token_id=1)
    with pytest.raises(ValueError, match="head_dim is 12; use --backend numpy"):
        check_model(resolve("cpu"), config)


def test_a_whole_model_step_matches_numpy(tiny_dir):
    """The tiny model through both backends: a prefill step, then a step that mixes a prefill
    chunk on a cached prefix with decode rows; the logits agree to float32 rounding."""
    from model.runner import ModelRunner, Row, StepPlan

    runners = [ModelRunner.from_dir(tiny_dir, num_blocks=32, block_size=4, ops=ops) for ops in (NUMPY, NUMBA)]
    prompts = [[5, 9, 11, 30, 2, 7], [40, 41, 42], [3] * 13]
    tables = [[0, 1], [2], [3, 4, 5, 6]]
    first = StepPlan([Row(i, p, 0, t, sample=True) for i, (p, t) in enumerate(zip(prompts, tables))])
    second = StepPlan([Row(0, [8], 6, tables[0] + [7], sample=True), Row(1, [50], 3, tables[1] + [8]),
                       Row(2, [4, 4, 4], 13, tables[2] + [9], sample=True)])
    for plan in (first, second):
        want, got = (runner.logits(plan) for runner in runners)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_batch_sampler_draws_what_numpy_draws(rng):
    """Greedy rows exactly; seeded temperature rows the same token except where float rounding
    moves a CDF boundary; filtered, penalised, masked and logprob rows through NumpyOps itself."""
    from model.sampling import SamplingParams

    vocab, rows = 300, 240
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 3
    params = [SamplingParams(temperature=0.0) if r % 3 == 0 else
              SamplingParams(temperature=0.5 + r % 5 * 0.3, seed=r) if r % 3 == 1 else
              SamplingParams(temperature=0.8, top_k=20, seed=r, logprobs=2) for r in range(rows)]
    history = [[1, 2]] * rows
    batch = SampleBatch(params, history, history, np.random.default_rng(0))
    want = NUMPY.sample(logits.copy(), batch)
    got = NUMBA.sample(np.asfortranarray(logits), batch)  # strided rows, as the LM head gives
    want, want_lp, want_top = want.token_ids, want.logprobs, want.top_logprobs
    got, got_lp, got_top = got.token_ids, got.logprobs, got.top_logprobs
    greedy = [r for r in range(rows) if r % 3 == 0]
    np.testing.assert_array_equal(got[greedy], want[greedy])
    seeded = [r for r in range(rows) if r % 3 == 1]
    assert np.mean(got[seeded] == want[seeded]) >= 0.97
    filtered = [r for r in range(rows) if r % 3 == 2]
    np.testing.assert_array_equal(got[filtered], want[filtered])
    assert [got_lp[r] for r in filtered] == [want_lp[r] for r in filtered] and got_top == want_top


def test_a_plain_temperature_draw_follows_the_softmax():
    from model.sampling import SamplingParams

    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 4000, dtype=np.float32))
    params = [SamplingParams(temperature=1.0)] * 4000
    ids = NUMBA.sample(logits, SampleBatch(params, [[]] * 4000, [[]] * 4000, np.random.default_rng(1))).token_ids
    share = np.bincount(ids, minlength=4) / 4000
    np.testing.assert_allclose(share, [0.1, 0.2, 0.3, 0.4], atol=0.03)


def test_the_first_start_on_a_machine_says_it_compiled_the_kernels_and_the_next_does_not(tmp_path):
    """A cache that lacks some kernels (this checkout's, less the row-wise and sampling modules':
    a few seconds to compile, where every kernel takes minutes) is filled by the first start."""
    import numba
    from live_server import LiveServer

    shutil.copytree(numba.config.CACHE_DIR, tmp_path, dirs_exist_ok=True)  # NumbaOps' import filled it
    for module in ("numba_rowwise", "numba_sampler"):
        for compiled in tmp_path.rglob(f"{module}.*"):
            compiled.unlink()
    logs = []
    for _ in range(2):
        server = LiveServer("--kv-cache-gib", "0.05", env={"NUMBA_CACHE_DIR": str(tmp_path)})
        server.assert_serving()
        assert server.stop() == 0
        logs.append(server.log_path.read_text())
    assert "compiled the CPU kernels" in logs[0], logs[0]
    assert "compiled the CPU kernels" not in logs[1] and "backend cpu (q8_0" in logs[1], logs[1]
