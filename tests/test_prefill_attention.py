"""The tiled attention kernel (model/ops/numba_attention.py) on prompts: against NumPy's
(NumpyOps.paged_attention, the oracle) at the shapes the families have, and the same bits for a
token however its prompt is cut into chunks and tiles and whatever shares its step."""

import numpy as np
import pytest

from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from tiny_model import make_tiny_model

NUMPY = NumpyOps()
OPS = {"float32": NumbaOps(), "float16": NumbaOps("q8_0")}  # K/V as each keeps them


class Cache:
    """One layer's paged K/V for some rows, written by NumpyOps and by NumbaOps (each in its own
    layout) from the same values, each row's blocks scattered through the cache."""

    def __init__(self, rng, context_lens, kv_heads, dim, block_size, kv):
        self.block_size, self.ops = block_size, OPS[kv]
        blocks = sum(-(-c // block_size) for c in context_lens) + 3
        free = list(rng.permutation(blocks))
        self.tables = [[int(free.pop()) for _ in range(-(-c // block_size))] for c in context_lens]
        shape = (kv_heads, blocks, block_size, dim)
        self.want = [np.zeros(shape, np.float32) for _ in range(2)]
        nan = np.full(shape, np.nan, np.float32 if kv == "float32" else np.float16)
        self.got = [nan.view(self.ops.storage_dtype).copy() for _ in range(2)]
        for table, n in zip(self.tables, context_lens):
            k, v = (rng.standard_normal((n, kv_heads, dim), dtype=np.float32) for _ in range(2))
            if kv == "float16":  # what NumPy attends over: the values the cache keeps
                k, v = (x.astype(np.float16).astype(np.float32) for x in (k, v))
            slots = np.array([table[p // block_size] * block_size + p % block_size for p in range(n)])
            NUMPY.write_kv(*self.want, slots, k, v)
            self.ops.write_kv(*self.got, slots, k, v)

    def attend(self, ops, q, query_lens, context_lens, tables=None, **kw):
        caches = self.want if ops is NUMPY else self.got
        meta = ops.attention_meta(query_lens, context_lens, tables or self.tables, self.block_size)
        return ops.paged_attention(q, *caches, meta, 0.125, **kw)


@pytest.mark.parametrize("heads, kv_heads, dim", [
    (4, 4, 64), (8, 4, 64), (16, 4, 128), (8, 1, 256), (16, 2, 80), (32, 8, 64),  # GQA groups 1, 2, 4, 8
])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (37, 0.0), (0, 30.0), (100, 50.0)])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_the_tiled_kernel_matches_numpy(heads, kv_heads, dim, window, softcap, kv):
    """Ragged rows: decode rows of assorted contexts beside a whole prompt and chunks on cached
    prefixes (the NaN-filled cache behind them must never be read)."""
    rng = np.random.default_rng(dim + heads + window)
    query_lens, context_lens = [1, 150, 1, 37, 70], [300, 150, 16, 53, 211]
    cache = Cache(rng, context_lens, kv_heads, dim, 16, kv)
    q = rng.standard_normal((sum(query_lens), heads, dim), dtype=np.float32)
    want = cache.attend(NUMPY, q, query_lens, context_lens, window=window, softcap=softcap)
    got = cache.attend(cache.ops, q, query_lens, context_lens, window=window, softcap=softcap)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_a_token_is_the_same_bits_in_any_chunk_tile_or_company(block_size):
    """A 300-token prompt attended whole, in random chunks on its own cached prefix, one token at
    a time as decode rows, and beside other rows: every token's output the same bits."""
    rng = np.random.default_rng(block_size)
    heads, kv_heads, dim, n = 12, 3, 64, 300
    cache = Cache(rng, [n, 90, 40], kv_heads, dim, block_size, "float16")
    q = rng.standard_normal((n, heads, dim), dtype=np.float32)
    for kw in ({}, {"window": 50}, {"softcap": 20.0}):
        whole = cache.attend(cache.ops, q, [n], [n], cache.tables[:1], **kw)
        cuts = np.sort(rng.choice(np.arange(1, n), size=12, replace=False)).tolist()
        for lo, hi in zip([0] + cuts, cuts + [n]):
            chunk = cache.attend(cache.ops, q[lo:hi], [hi - lo], [hi], cache.tables[:1], **kw)
            np.testing.assert_array_equal(chunk, whole[lo:hi])
        for t in (0, 15, 16, 17, 151, 299):
            decode = cache.attend(cache.ops, q[t:t + 1], [1], [t + 1], cache.tables[:1], **kw)
            np.testing.assert_array_equal(decode, whole[t:t + 1])
        others = rng.standard_normal((1 + 40, heads, dim), dtype=np.float32)
        beside = cache.attend(cache.ops, np.concatenate([others[:1], q[100:250], others[1:]]), [1, 150, 40],
                              [90, 250, 40], [cache.tables[1], cache.tables[0], cache.tables[2]], **kw)
        np.testing.assert_array_equal(beside[1:151], whole[100:250])


def test_a_prompts_logits_are_the_same_bits_whole_and_in_random_chunks(tmp_path):
    """Through the model on the default dtype (q8_0, float16 K/V), blocks of 16: a 260-token
    prompt prefilled in one step, and in random chunks beside another request's decode rows;
    the logits of every chunk's last token, and of the step after."""
    path = make_tiny_model(tmp_path, hidden=256, heads=8, kv_heads=2, intermediate=256)
    runner = ModelRunner.from_dir(path, num_blocks=64, block_size=16, ops=NumbaOps("q8_0"))
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, runner.config.vocab_size, 260).tolist()
    other = rng.integers(0, runner.config.vocab_size, 30).tolist()
    runner.logits(StepPlan([Row("o", other, 0, list(range(40, 42)))]))

    def run(cuts, table, company):
        logits = []
        for lo, hi in zip([0] + cuts, cuts + [len(prompt)]):
            rows = [Row("p", prompt[lo:hi], lo, table, sample=True)]
            if company:
                rows.insert(0, Row("o", [7], len(other), list(range(40, 42)), sample=True))
            logits.append(np.asarray(runner.logits(StepPlan(rows)))[-1])
        logits.append(np.asarray(runner.logits(StepPlan([Row("p", [5], len(prompt), table, sample=True)])))[0])
        return logits, [hi for hi in cuts + [len(prompt)]]

    cuts = np.sort(rng.choice(np.arange(1, len(prompt)), size=6, replace=False)).tolist()
    chunked, ends = run(cuts, list(range(0, 20)), company=True)
    for end, got in zip(ends, chunked):
        whole = run([end] if end < len(prompt) else [], list(range(20, 40)), company=False)[0][0]
        np.testing.assert_array_equal(got, whole)
    np.testing.assert_array_equal(chunked[-1], run([], list(range(20, 40)), company=False)[0][-1])


def test_the_break_even_the_planner_sizes_chunks_by(tmp_path):
    """Real checkpoints' configs: Llama-3.2-1B's projections and MLP are 2048 x (2 x 2048 + 2 x
    512 + 3 x 8192) multiply-adds a layer, its attention 2 x 2048 a cached position, so a token
    at 14,848 positions does as much of each; Qwen3-30B-A3B counts its 8 routed experts of 768."""
    from model.config import ModelConfig

    llama = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)
    assert ModelConfig.from_dict(llama).attention_break_even == 14848
    qwen = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
    assert ModelConfig.from_dict(qwen).attention_break_even == 2048 * (2 * 4096 + 2 * 512 + 3 * 8 * 768) // 8192
    runner = ModelRunner.from_dir(make_tiny_model(tmp_path), num_blocks=4, ops=NumbaOps("q8_0"))
    assert runner.prefill_break_even == runner.config.attention_break_even / NumbaOps.attention_cost
