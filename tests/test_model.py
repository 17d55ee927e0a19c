"""The forward pass on tiny random models: against a dense reference, chunked, batched, seeded."""

import numpy as np
import pytest

from model.config import ModelConfig
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from model.weights import read_model_tensors
from reference import dense_logits

TEXT = ("The capital of France is Paris. Hello world! How are you today? "
        "def add(a, b): return a + b. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. ") * 4


def rel_err(a, b) -> float:
    """Largest difference, relative to the largest logit."""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


class Blocks:
    """Hands out block ids in a shuffled order, so block tables are never contiguous."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.free = list(np.random.default_rng(seed).permutation(runner.num_blocks))
        self.tables: dict = {}
        self.size = runner.block_size

    def table(self, rid, length: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.size < length:
            table.append(int(self.free.pop()))
        return list(table)


def prefill_row(blocks, rid, ids, start, sample=True, **kw):
    return Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=sample, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return ModelRunner.from_dir(tiny_dir, num_blocks=256), Tokenizer(tiny_dir)


@pytest.mark.parametrize("variant,tie", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_forward_matches_dense_reference(tiny_variant_dir, variant, tie):
    path = tiny_variant_dir(variant, tie)
    config = ModelConfig.load(path)
    runner = ModelRunner.from_dir(path, num_blocks=64)
    ids = Tokenizer(path).encode(TEXT)[:70]
    expected = dense_logits(config, read_model_tensors(path), ids)
    blocks = Blocks(runner)
    logits = runner.logits(StepPlan([prefill_row(blocks, "a", ids[:60], 0)]))
    assert logits.dtype == np.float32
    assert rel_err(logits[0], expected[59]) < 1e-5
    for pos in range(60, 70):  # decode steps, one token each
        logits = runner.logits(StepPlan([prefill_row(blocks, "a", [ids[pos]], pos)]))
        assert rel_err(logits[0], expected[pos]) < 1e-5


def test_variant_weights_matter(tiny_variant_dir):
    """The Qwen2 bias and Qwen3 q/k norms are really applied: dropping them changes logits."""
    for variant, dropped in (("qwen2", "bqkv"), ("qwen3", "q_norm")):
        runner = ModelRunner.from_dir(tiny_variant_dir(variant), num_blocks=16)
        plan = StepPlan([Row("a", [5, 9, 30, 41], 0, [0], sample=True)])
        before = runner.logits(plan)
        for layer in runner.model.w.layers:
            setattr(layer, dropped, None)
            if dropped == "q_norm":
                layer.k_norm = None
        assert rel_err(runner.logits(plan), before) > 1e-3


def test_paged_attention_equals_dense():
    rng = np.random.default_rng(1)
    kv_heads, heads, dim, block = 2, 6, 8, 4
    cache_k = rng.standard_normal((kv_heads, 64, block, dim)).astype(np.float32)
    cache_v = rng.standard_normal((kv_heads, 64, block, dim)).astype(np.float32)
    # (queries, context): decode rows, a first prefill, and a prefill chunk on a cached prefix
    shapes = [(1, 1), (1, 17), (5, 5), (3, 11), (1, 30), (9, 23), (1, 2), (2, 9), (1, 13), (4, 4)]
    perm = iter(rng.permutation(64))
    tables = [[int(next(perm)) for _ in range(-(-ctx // block))] for _, ctx in shapes]
    q = rng.standard_normal((sum(n for n, _ in shapes), heads, dim)).astype(np.float32)
    ops = NumpyOps()
    meta = ops.attention_meta([n for n, _ in shapes], [c for _, c in shapes], tables, block)
    out = ops.paged_attention(q, cache_k, cache_v, meta, 0.3)

    start = 0
    for (n, ctx), table in zip(shapes, tables):
        slots = [table[p // block] * block + p % block for p in range(ctx)]
        k = cache_k.reshape(kv_heads, -1, dim)[:, slots].transpose(1, 0, 2).astype(np.float64)
        v = cache_v.reshape(kv_heads, -1, dim)[:, slots].transpose(1, 0, 2).astype(np.float64)
        for i in range(n):
            qpos = ctx - n + i
            for h in range(heads):
                s = k[: qpos + 1, h // 3] @ q[start + i, h] * 0.3
                p = np.exp(s - s.max())
                ref = (p / p.sum()) @ v[: qpos + 1, h // 3]
                np.testing.assert_allclose(out[start + i, h * dim:(h + 1) * dim], ref, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(tiny, chunk):
    runner, tok = tiny
    ids = tok.encode(TEXT)[:150]
    blocks = Blocks(runner)
    one_shot = runner.logits(StepPlan([prefill_row(blocks, "whole", ids, 0)]))[0]
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        last = start + len(piece) == len(ids)
        logits = runner.logits(StepPlan([prefill_row(blocks, "chunked", piece, start, sample=last)]))
    assert rel_err(logits[0], one_shot) < 1e-5
    # and the caches hold the same thing: one decode step on each agrees too
    step = [prefill_row(blocks, rid, [7], len(ids)) for rid in ("whole", "chunked")]
    a, b = runner.logits(StepPlan(step))
    assert rel_err(a, b) < 1e-5


def greedy_decode(runner, blocks, rids, prompts, steps):
    """Decode the rows together; returns per row the tokens and the logits of every step."""
    tokens = {rid: [] for rid in rids}
    logits = {rid: [] for rid in rids}
    plan = [prefill_row(blocks, rid, p, 0) for rid, p in zip(rids, prompts)]
    for _ in range(steps):
        out = runner.logits(StepPlan(plan))
        for row, lg in zip(plan, out):
            tokens[row.request_id].append(int(np.argmax(lg)))
            logits[row.request_id].append(lg.copy())
        plan = [prefill_row(blocks, r.request_id, [tokens[r.request_id][-1]],
                            r.start_pos + len(r.token_ids)) for r in plan]
    return tokens, logits


def test_row_in_batch_of_8_equals_row_alone(tiny):
    runner, tok = tiny
    ids = tok.encode(TEXT)
    prompts = [ids[i * 7: i * 7 + 5 + 9 * i] for i in range(8)]
    rids = [f"r{i}" for i in range(8)]
    blocks = Blocks(runner, seed=3)
    batch_tokens, batch_logits = greedy_decode(runner, blocks, rids, prompts, 12)
    for rid, prompt in zip(rids, prompts):
        alone_tokens, alone_logits = greedy_decode(runner, blocks, [rid + "-alone"], [prompt], 12)
        for step, (a, b) in enumerate(zip(alone_logits[rid + "-alone"], batch_logits[rid])):
            assert rel_err(b, a) < 1e-5, (rid, step)
        assert alone_tokens[rid + "-alone"] == batch_tokens[rid]


def sample_run(runner, blocks, requests, steps):
    """requests: {rid: (prompt, params)}; sample all rows together for `steps` tokens."""
    out = {rid: [] for rid in requests}
    pos = {rid: 0 for rid in requests}
    feed = {rid: list(p) for rid, (p, _) in requests.items()}
    for _ in range(steps):
        rows = [Row(rid, feed[rid], pos[rid], blocks.table(rid, pos[rid] + len(feed[rid])), sample=True,
                    params=requests[rid][1], prompt_ids=requests[rid][0], output_ids=out[rid])
                for rid in requests]
        for s in runner.step(StepPlan(rows)):
            pos[s.request_id] += len(feed[s.request_id])
            out[s.request_id].append(s.token_id)
            feed[s.request_id] = [s.token_id]
    return out


def test_same_seed_same_tokens_alone_and_in_batch(tiny):
    runner, tok = tiny
    ids = tok.encode(TEXT)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    blocks = Blocks(runner, seed=5)
    alone = sample_run(runner, blocks, {"a": (ids[:20], seeded)}, 16)["a"]
    again = sample_run(runner, blocks, {"b": (ids[:20], seeded)}, 16)["b"]
    batch = sample_run(runner, blocks, {
        "x": (ids[40:77], SamplingParams(temperature=0.7, seed=9)),
        "c": (ids[:20], seeded),
        "y": (ids[10:13], SamplingParams(temperature=1.0)),
        "z": (ids[5:60], SamplingParams(temperature=0.0)),
    }, 16)
    assert alone == again == batch["c"]
    other = sample_run(runner, blocks, {"d": (ids[:20], SamplingParams(temperature=1.0, top_p=0.95, seed=4321))}, 16)
    assert other["d"] != alone
