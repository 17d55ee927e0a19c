"""Memory and host syncs of a GPU step (issue 51), on the CPU harness: the decode graphs' one
logits buffer and its place in the memory plan, and logprobs fetched with the sampled ids in
the step's one download instead of copies of their own."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from model.cuda_graphs import graph_sizes, logits_bytes
from model.kv_cache import KVCache
from model.memory import GIB, plan_kv_cache
from model.ops.cuda_ops import CudaOps
from model.ops.numpy_ops import NumpyOps
from model.ops.protocol import SampleBatch
from model.runner import ModelRunner, Row, StepPlan, load_model
from model.sampling import SamplingParams
from test_cuda_graphs import BACKENDS, harness_model, runners
from test_model import Blocks, rel_err


def address(array) -> int:
    """Where an array's first element lives (NumPy on the harness, CuPy on a GPU)."""
    return array.data.ptr if hasattr(array.data, "ptr") else array.ctypes.data


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_decode_graph_writes_its_logits_into_one_buffer(tiny_dir, backend):
    """Graphs of 1, 2, 4 and 6 rows hand out views of one (6, vocab) fp32 buffer, and a replay of
    each still gives the bits of an eager step of as many rows."""
    graphed, eager = runners(tiny_dir, backend)
    graphs, blocks = graphed.graphs, Blocks(eager)
    shared = graphs.logits
    assert shared.shape == (6, graphed.model.w.lm_head.shape[0]) and shared.dtype == np.float32
    assert shared.nbytes == logits_bytes(6, shared.shape[1])
    for size, graph in graphs.graphs.items():
        assert graph.output.shape[0] == size and address(graph.output) == address(shared)
    rng = np.random.default_rng(5)
    prompts = {rid: rng.integers(3, 390, int(n)).tolist() for rid, n in zip("abcdef", rng.integers(3, 20, 6))}
    for rid, ids in prompts.items():
        plan = StepPlan([Row(rid, ids, 0, blocks.table(rid, len(ids)), sample=True)])
        for runner in (graphed, eager):
            runner.logits(plan)
    position = {rid: len(ids) for rid, ids in prompts.items()}
    for rids in ["abcdef", "a", "abcd", "ab", "abc"]:  # each graph (6, 1, 4, 2 rows), then 3 rows padded to 4
        plan = StepPlan([Row(rid, [int(rng.integers(3, 390))], position[rid], blocks.table(rid, position[rid] + 1),
                             sample=True) for rid in rids])
        before = graphs.replays
        got, want = (runner.ops.to_host(runner.logits(plan)) for runner in (graphed, eager))
        assert graphs.replays == before + 1
        if len(rids) in graphs.sizes:
            assert np.array_equal(got, want), rids
        else:  # a GEMM of 4 rows against one of 3: BLAS may sum in another order (FIELD-NOTES)
            assert rel_err(got, want) < 1e-5
        for rid in rids:
            position[rid] += 1


def test_the_memory_plan_holds_the_graphs_logits_buffer_beside_the_kv_cache(tiny_dir):
    """Planned for graphs, the KV cache leaves room for their buffer (max_seqs rows of fp32
    logits); at 256 rows of Llama 3's 128,256-token vocabulary, one buffer for all graphs is
    131 MB where a buffer per graph held 2.17 GB."""
    total = 8 * GIB
    model = harness_model(tiny_dir, (5 * GIB, total))
    eager, graphed = (plan_kv_cache(model, 0.9, max_seqs=8, max_batched_tokens=64, max_model_len=128, block_size=4,
                                    graphs=graphs) for graphs in (False, True))
    vocab = model.w.lm_head.shape[0]
    assert eager.held == 0 and graphed.held == logits_bytes(8, vocab) == 8 * vocab * 4
    assert graphed.used == eager.used
    assert graphed.num_blocks == (int(total * 0.9) - graphed.used - graphed.held) // graphed.block_bytes
    assert eager.num_blocks - graphed.num_blocks == pytest.approx(graphed.held / graphed.block_bytes, abs=1)
    assert "for the decode graphs' logits" in graphed.describe()
    assert sum(graph_sizes(256)) * 128256 * 4 == 2_170_604_544  # before: each graph's own
    assert logits_bytes(256, 128256) == 131_334_144


def test_a_draft_models_weights_and_cache_come_off_the_kv_cache(tiny_dir):
    """A draft model is on the device before the profile (app/flags.load_draft), so the device
    reports its weights as used; and every block of the pool holds the draft's K/V beside the
    model's, so the blocks are what the budget leaves over both."""
    total, free = 8 * GIB, 5 * GIB
    model = harness_model(tiny_dir, (free, total))
    alone = plan_kv_cache(model, 0.9, max_seqs=8, max_batched_tokens=64, max_model_len=128, block_size=4)
    draft = load_model(tiny_dir, model.ops)
    model.ops.launcher.memory = (free - draft.weight_bytes, total)  # what the device says with the draft loaded
    beside = plan_kv_cache(model, 0.9, max_seqs=8, max_batched_tokens=64, max_model_len=128, block_size=4,
                           draft=draft)
    draft_block = KVCache.bytes_per_block_of(model.ops, draft.config, 4)
    assert beside.used == alone.used + draft.weight_bytes
    assert beside.block_bytes == alone.block_bytes + draft_block
    budget = int(total * 0.9)
    assert beside.num_blocks == (budget - alone.used - draft.weight_bytes) // (alone.block_bytes + draft_block)
    assert beside.num_blocks * beside.block_bytes + beside.used <= budget < alone.num_blocks * beside.block_bytes


class CountedDownloads(CpuLauncher):
    """Every copy to the host a step makes: the launcher's queued downloads, and CuPy's asnumpy
    (what CudaOps.to_host calls on a GPU), each by its bytes."""

    def __init__(self):
        super().__init__()
        self.downloaded: list[int] = []

    def download(self, device):
        self.downloaded.append(device.nbytes)
        return super().download(device)

    def arrays(self):
        launcher = self

        class HostCopiesCounted:
            def __getattr__(self, name):
                return getattr(np, name)

            def asnumpy(self, x):
                launcher.downloaded.append(x.nbytes)
                return np.asarray(x)
        return HostCopiesCounted()


def test_a_step_with_logprobs_downloads_its_ids_and_top_entries_once(tiny_dir):
    """A replayed decode step of three rows, two asking for logprobs (5 and 2): one download of
    the ids and 2 + 2 x 5 words a row, never the logits; the logprobs are NumPy's on the eager
    step's logits. A prefill row's prompt logprobs come in the same download (four copies of
    their own before, each a wait)."""
    launcher = CountedDownloads()
    ops = CudaOps(np, launcher)
    ops.xp = launcher.arrays()
    graphed = ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=ops)
    graphed.capture_graphs(4, 64)
    eager = ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=CudaOps(np, CpuLauncher()))
    blocks = Blocks(eager)
    prompts = {"a": [5, 9, 31, 7], "b": [11, 3], "c": [8, 8, 40, 2, 17]}
    for rid, ids in prompts.items():
        plan = StepPlan([Row(rid, ids, 0, blocks.table(rid, len(ids)), sample=True)])
        for runner in (graphed, eager):
            runner.step(plan)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=2)]
    plan = StepPlan([Row(rid, [13], len(ids), blocks.table(rid, len(ids) + 1), sample=True, params=p)
                     for (rid, ids), p in zip(prompts.items(), params)])
    launcher.downloaded.clear()
    replays = graphed.graphs.replays
    got = graphed.step(plan)
    assert graphed.graphs.replays == replays + 1
    assert launcher.downloaded == [3 * (2 + 2 * 5) * 4]
    logits = eager.ops.to_host(eager.logits(plan))
    want = NumpyOps().sample(logits, SampleBatch(params, [[]] * 3, [[]] * 3, np.random.default_rng(0)))
    assert [s.token_id for s in got] == want.token_ids.tolist()
    for sampled, logprob, top, p in zip(got, want.logprobs, want.top_logprobs, params):
        if p.logprobs is None:
            assert sampled.logprob is None and sampled.top_logprobs is None
            continue
        assert sampled.logprob == pytest.approx(logprob, abs=1e-5)
        assert [t for t, _ in sampled.top_logprobs] == [t for t, _ in top]
        np.testing.assert_allclose([v for _, v in sampled.top_logprobs], [v for _, v in top], atol=1e-5)

    prompt = [3, 14, 15, 92, 65, 35]  # a prefill chunk whose 5 predicted prompt tokens are scored, top 3
    plan = StepPlan([Row("d", prompt, 0, blocks.table("d", 6), sample=True, params=params[2], prompt_ids=prompt,
                         prompt_logprobs=3)])
    launcher.downloaded.clear()
    got = graphed.step(plan)[0]
    assert launcher.downloaded == [(1 * (2 + 2 * 2) + 5 * (2 + 2 * 3)) * 4]  # the ids' array and the scores', joined
    logits = eager.ops.to_host(eager.forward(plan)[0])  # the sampled row's, then the 5 scored positions'
    reference = NumpyOps().score(logits[1:], prompt[1:], 3)
    assert [t for t, _, _, _ in got.prompt_logprobs] == prompt[1:]
    assert [rank for _, _, rank, _ in got.prompt_logprobs] == reference.ranks
    np.testing.assert_allclose([lp for _, lp, _, _ in got.prompt_logprobs], reference.logprobs, atol=1e-5)
    assert [[t for t, _ in top] for *_, top in got.prompt_logprobs] == [[t for t, _ in top]
                                                                       for top in reference.top_logprobs]
    assert got.logprob == pytest.approx(NumpyOps().sample(logits[:1], SampleBatch(
        [params[2]], [prompt], [[]], np.random.default_rng(0))).logprobs[0], abs=1e-5)
