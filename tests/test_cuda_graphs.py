"""CUDA graphs for decode (model/cuda_graphs.py) and KV sizing by --gpu-memory-utilization
(model/memory.py), on the CPU harness: the same CudaOps and kernels as on a GPU, with a graph
stand-in whose replay runs the captured forward pass again on the fixed buffers. What that
checks is the bookkeeping a GPU relies on: the padded sizes, what a step writes into the buffers
(padding included), which steps replay, and that the logits, the sampled tokens and the K/V
cache are those of eager steps. On a GPU (marked gpu) the same tests capture real graphs."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from engine_harness import Harness
from model.cuda_graphs import MAX_PADDING, graph_sizes
from model.memory import GIB, gpu_kv_blocks, plan_kv_cache, profile_plan
from model.ops.cuda_ops import CudaOps
from model.runner import AHEAD, ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from test_cuda_forward import cuda_ops
from test_model import Blocks, rel_err

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("max_seqs", [1, 2, 3, 5, 8, 9, 64, 100, 256])
def test_graph_sizes_cover_every_batch_with_little_padding(max_seqs):
    sizes = graph_sizes(max_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_seqs
    for rows in range(1, max_seqs + 1):
        padded = next(s for s in sizes if s >= rows)
        assert padded - rows < max(rows, MAX_PADDING)  # doubling up to 8, then at most 7 rows more
    if max_seqs == 64:
        assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def runners(tiny_dir, backend, max_seqs=6, max_model_len=96):
    """Two runners on the kernels with the same weights: one replays graphs, one runs eagerly."""
    made = [ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=cuda_ops(backend)) for _ in range(2)]
    made[0].capture_graphs(max_seqs, max_model_len)
    return made


@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_decode_steps_match_eager_ones(tiny_dir, backend):
    """Decode steps of 1 to 6 rows (padded to 1, 2, 4 and 6) give the eager logits; a prefill and
    a mixed step run eagerly; padding writes no K/V (the caches stay equal)."""
    graphed, eager = runners(tiny_dir, backend)
    graphs = graphed.graphs
    assert graphs.sizes == [1, 2, 4, 6] and set(graphs.graphs) == {1, 2, 4, 6}
    blocks = Blocks(eager)
    rng = np.random.default_rng(3)
    lengths = {rid: int(n) for rid, n in zip("abcdef", rng.integers(3, 30, 6))}
    prompts = {rid: rng.integers(3, 390, n).tolist() for rid, n in lengths.items()}

    def step(rows):
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        before = graphs.replays
        got, want = (r.ops.to_host(r.logits(plan)) for r in (graphed, eager))
        assert got.shape == want.shape and rel_err(got, want) < 1e-5, rel_err(got, want)
        return graphs.replays - before

    assert step([(rid, prompts[rid], 0) for rid in "abcd"]) == 0  # prefill: eager
    position = dict(lengths)
    for rids in ["abc", "a", "abcd", "bd"]:  # 3 rows pad to 4; 1; 4; 2
        assert step([(rid, [int(rng.integers(3, 390))], position[rid]) for rid in rids]) == 1
        for rid in rids:
            position[rid] += 1
    mixed = [("a", [7], position["a"]), ("e", prompts["e"], 0)]
    assert step(mixed) == 0
    position["a"] += 1
    assert step([("f", prompts["f"], 0)]) == 0
    position["e"], position["f"] = lengths["e"], lengths["f"]
    assert step([(rid, [int(rng.integers(3, 390))], position[rid]) for rid in "abcdef"]) == 1  # the largest graph
    for ours, theirs in zip(graphed.cache.k + graphed.cache.v, eager.cache.k + eager.cache.v):
        assert np.allclose(graphed.ops.to_host(ours), eager.ops.to_host(theirs), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_step_buffers_hold_the_rows_then_padding(tiny_dir, backend):
    graphed, _ = runners(tiny_dir, backend, max_seqs=8, max_model_len=40)
    graphs = graphed.graphs
    rows = [Row("a", [11], 9, [5, 2, 7], sample=True), Row("b", [12], 0, [3], sample=True),
            Row("c", [13], 4, [1, 6], sample=True)]
    graphs.fill(rows)
    first = graphs.host
    fields = first[:4 * 8].reshape(4, 8)
    tables = first[4 * 8:].reshape(8, 10)  # 40 tokens in blocks of 4: 10 columns
    assert fields[0].tolist() == [11, 12, 13, 0, 0, 0, 0, 0]  # token ids
    assert fields[1].tolist() == [9, 0, 4, 0, 0, 0, 0, 0]  # positions
    assert fields[2].tolist() == [7 * 4 + 1, 3 * 4, 6 * 4, -1, -1, -1, -1, -1]  # slots; padding writes nothing
    assert fields[3].tolist() == [10, 1, 5, 1, 1, 1, 1, 1]  # context lengths
    assert tables[:3, :3].tolist() == [[5, 2, 7], [3, 0, 0], [1, 6, 0]] and not tables[3:].any()
    graphs.fill(rows)  # the other host array: steps take turns
    assert graphs.host is not first and np.array_equal(graphs.host, first)
    graphs.fill(rows[1:2])  # this one again, with fewer rows: the earlier rows' tables are cleared
    assert graphs.host is first
    assert tables[0].tolist() == [3] + [0] * 9 and not tables[1:].any()
    assert graphs.padded_size(3) == 4 and graphs.padded_size(5) == 8
    assert not graphs.can_replay(StepPlan([Row("a", [1, 2], 0, [0], sample=True)]))  # a prefill row
    assert not graphs.can_replay(StepPlan([Row("a", [1], 3, [0], sample=False)]))  # a row that does not sample
    assert not graphs.can_replay(StepPlan([Row(i, [1], 3, [0], sample=True) for i in range(9)]))  # too many
    assert not graphs.can_replay(StepPlan([Row("a", [1], 3, list(range(11)), sample=True)]))  # a table too wide
    assert graphs.can_replay(StepPlan([Row(i, [1], 3, [0], sample=True) for i in range(8)]))


def test_a_graphs_attention_partials_are_sized_by_the_split_count_not_max_model_len(tiny_dir):
    """A decode graph plans attention for max_model_len; its partials (heads x splits x head_dim
    floats per row) must not grow with it: 128k tokens in splits of 512 made 256 splits, about
    1 GB per layer at 256 rows of an 8B model."""
    from model.ops.decode_attention import decode_splits

    launcher, partials = CpuLauncher(), []
    ops = CudaOps(np, launcher)
    function = launcher.function

    def recording(file, expression):
        kernel = function(file, expression)
        if expression.startswith("decode_attention<"):
            return lambda grid, block, args, shared_mem=0: (partials.append(args[0].shape),
                                                            kernel(grid, block, args, shared_mem))
        return kernel
    launcher.function = recording
    kv_heads, heads, head_dim, block_size = 2, 4, 64, 16
    cache_k = ops.zeros((kv_heads, 8, block_size, head_dim))
    q = np.ones((3, heads, head_dim), dtype=np.float32)
    meta = ops.attention_meta([1] * 3, [5, 40, 17], [[0], [1, 2, 3], [4, 5]], block_size)
    meta.max_context = 1 << 17  # what a graph captured for max_model_len plans with
    out = ops.paged_attention(q, cache_k, cache_k, meta, 0.125)
    assert partials[-1] == (3, heads, decode_splits(CpuLauncher.multiprocessors, kv_heads)) and partials[-1][2] <= 64
    assert np.isfinite(out).all()


class CountedLaunches(CpuLauncher):
    """Every launch a GPU step would make: Spool's kernels and cuBLAS GEMMs by name, and the
    copies CuPy would launch for ascontiguousarray, array or asarray on an array that is not
    already what was asked (the harness's arrays are NumPy's, so those copies are counted here)."""

    def __init__(self):
        super().__init__()
        self.launches: list[str] = []

    def function(self, file, expression):
        kernel = super().function(file, expression)
        return lambda grid, block, args, shared_mem=0: (self.launches.append(expression),
                                                         kernel(grid, block, args, shared_mem))

    def linear(self, x, w, bias, out):
        self.launches.append("gemm")
        super().linear(x, w, bias, out)

    def counting(self, xp):
        launcher = self

        class CountingArrays:
            def __getattr__(self, name):
                return getattr(xp, name)

            def _copy(self, name, x, *args, **kwargs):
                out = getattr(xp, name)(x, *args, **kwargs)
                if isinstance(x, xp.ndarray) and not xp.shares_memory(out, x):
                    launcher.launches.append(f"copy ({name})")
                return out

            def ascontiguousarray(self, x, *a, **k):
                return self._copy("ascontiguousarray", x, *a, **k)

            def array(self, x, *a, **k):
                return self._copy("array", x, *a, **k)

            def asarray(self, x, *a, **k):
                return self._copy("asarray", x, *a, **k)
        return CountingArrays()


@pytest.mark.parametrize("family,per_layer", [
    ("llama", [10, 10]),  # 16 before rotary, the copies and the K/V write became one kernel
    ("qwen3-yarn", [10, 10]),  # q/k norms in that kernel too: 19 before
    ("qwen3-moe", [13, 10]),  # a routed layer, then a dense one: 22 and 19 before
])
def test_a_decode_layer_launches_at_most_ten_kernels(tiny_dir, tmp_path, family, per_layer):
    """Launches per decode layer of a graph's forward pass, counted through the harness: the
    model cut to each of its layers alone, against none. Llama's, Qwen3's (q/k norms) and
    Qwen3-MoE's (q/k norms, and the experts' three more than an MLP's)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from family_models import make_family

    launcher = CountedLaunches()
    ops = CudaOps(np, launcher)
    ops.xp = launcher.counting(np)
    path = tiny_dir if family == "llama" else make_family(family, tmp_path)[0]
    runner = ModelRunner.from_dir(path, num_blocks=64, block_size=4, ops=ops, max_model_len=64)
    runner.capture_graphs(4, 64)
    blocks = Blocks(runner)
    rows = [Row(rid, [5], 9, blocks.table(rid, 10), sample=True) for rid in "abc"]
    layers = runner.model.w.layers
    counts = launches_with_layers(runner, launcher, rows, [[layer] for layer in layers] + [[]])
    assert [len(c) - len(counts[-1]) for c in counts[:-1]] == per_layer, counts[0]


def launches_with_layers(runner, launcher, rows, cuts) -> list[list[str]]:
    """The launches of a graph's decode forward pass over rows, with the model cut to each list
    of layers in turn (its layers put back after)."""
    layers, counts = runner.model.w.layers, []
    for kept in cuts:
        runner.model.w.layers = kept
        launcher.launches.clear()
        runner.graphs.fill(rows)
        runner.graphs.forward(runner.graphs.padded_size(len(rows)))
        counts.append(list(launcher.launches))
    runner.model.w.layers = layers
    return counts


def test_a_moe_decode_layer_launches_six_for_its_experts_where_an_mlp_takes_three(tmp_path):
    """Qwen3-MoE's routed layer against its dense one in a graph's decode forward pass, the model
    cut to each alone: the experts take 6 launches where an MLP takes 3 (the router's GEMM, the
    top k whose last block sorts the rows, two grouped GEMMs, the activation, the combine). 6 too
    before the router became a GEMM (moe_route, one block a token, and moe_align)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from family_models import make_family

    launcher = CountedLaunches()
    ops = CudaOps(np, launcher)
    ops.xp = launcher.counting(np)
    runner = ModelRunner.from_dir(make_family("qwen3-moe", tmp_path)[0], num_blocks=64, block_size=4, ops=ops,
                                  max_model_len=32)
    runner.capture_graphs(4, 32)
    blocks = Blocks(runner)
    rows = [Row(rid, [5], 9, blocks.table(rid, 10), sample=True) for rid in "abc"]
    layers = runner.model.w.layers
    assert layers[0].experts is not None and layers[1].experts is None
    counts = launches_with_layers(runner, launcher, rows, (layers[:1], layers[1:2]))
    routed = [name.split("<")[0] for name in counts[0] if name.startswith("moe_")]
    assert routed == ["moe_router", "moe_topk", "moe_gemm", "moe_gemm", "moe_combine"], counts[0]
    assert len(counts[0]) - len(counts[1]) == 6 - 3, (counts[0], counts[1])


class QueuedUploads(CpuLauncher):
    """Uploads as a GPU queues them: each returns an event, and the test sees which were waited on."""

    class Event:
        def __init__(self):
            self.waited = False

        def synchronize(self):
            self.waited = True

    def __init__(self):
        super().__init__()
        self.events, self.read = [], []  # per upload: its event, and the host array it read (a part of)

    def upload(self, device, host):
        super().upload(device, host)
        self.events.append(self.Event())
        self.read.append(host if host.base is None else host.base)
        return self.events[-1]


def test_a_step_never_fills_the_host_array_the_last_copy_may_still_read(tiny_dir):
    """The overlapped loop fills step N + 1 while step N's queued copy up may not have run: the
    steps take turns with two host arrays, and a turn waits for the copy two steps back (and only
    for that one)."""
    launcher = QueuedUploads()
    runner = ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=CudaOps(np, launcher))
    runner.capture_graphs(4, 64)
    blocks = Blocks(runner)
    for step in range(4):
        plan = StepPlan([Row(rid, [5 + step], 3 + step, blocks.table(rid, 4 + step), sample=True) for rid in "ab"])
        runner.step(plan)  # two copies a step, the fields and the tables: the second's event is the turn's
        assert launcher.read[-1] is launcher.read[-2] is not launcher.read[-3]  # not the last step's array
        assert not launcher.events[-3].waited  # and the last step's copy is not waited for
        if step:
            assert launcher.read[-1] is launcher.read[-5] and launcher.events[-5].waited


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_scheduler_on_graphs_generates_what_it_does_eagerly(tiny_dir, backend):
    """Through the engine's scheduler, with penalties, seeded draws, logprobs and preemption by
    recompute: graphs and the overlapped loop (rows fed AHEAD) give the tokens and logprobs of
    eager steps run one at a time; most steps replay."""
    tok = Tokenizer(tiny_dir)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 390, n).tolist() for n in (9, 23, 5, 14, 11)]
    sampling = [SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
                SamplingParams(temperature=0.8, seed=4), SamplingParams(temperature=0.0, frequency_penalty=0.7),
                SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, seed=2)]
    results = []
    for graphed in (True, False):
        runner = ModelRunner.from_dir(tiny_dir, num_blocks=16, block_size=4, ops=cuda_ops(backend))
        runner.overlaps = graphed
        if graphed:
            runner.capture_graphs(4, 64)
            launch = runner.launch

            def counting(plan):
                counting.ahead += sum(r.token_ids[0] == AHEAD for r in plan.rows)
                return launch(plan)

            counting.ahead = 0
            runner.launch = counting
        h = Harness(runner, tok, max_seqs=4, immunity_tokens=2)
        rids = [h.submit(p, sampling=s, max_tokens=12) for p, s in zip(prompts, sampling)]
        h.run()
        results.append(([h.tokens(r) for r in rids], [[lp for f in h.frames[r] for lp in f.logprobs or []]
                                                        for r in rids], h, runner))
    (tokens, logprobs, h, runner), (want_tokens, want_logprobs, _, _) = results
    assert h.stats.preemptions > 0
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        np.testing.assert_allclose([lp for _, lp, _ in got], [lp for _, lp, _ in want], atol=1e-4)
    assert runner.graphs.replays >= 12 and runner.launch.ahead >= 12


def harness_model(tiny_dir, memory):
    from model.runner import load_model

    return load_model(tiny_dir, CudaOps(np, CpuLauncher(memory=memory)))


def test_the_kv_cache_gets_what_the_fraction_leaves(tiny_dir):
    """(free, total) after the profiling step is what the harness reports; the throwaway cache's
    blocks are not counted as used."""
    total, free = 8 * GIB, 5 * GIB
    model = harness_model(tiny_dir, (free, total))
    memory = plan_kv_cache(model, 0.9, max_seqs=8, max_batched_tokens=64, max_model_len=128, block_size=4)
    throwaway = sum(len(r.block_table) for r in profile_plan(8, 64, 128, 4).rows)
    assert memory.used == total - free - throwaway * memory.block_bytes
    assert memory.num_blocks == (int(total * 0.9) - memory.used) // memory.block_bytes
    assert not model.ops.sampler.slots  # the profiling rows left no sampler state behind
    assert model.ops.launcher.released == 1  # and the pool gave the throwaway cache's memory back


@pytest.mark.parametrize("max_seqs,tokens,max_model_len", [(1, 1, 2), (8, 64, 128), (5, 37, 9), (64, 1024, 8192)])
def test_the_profiling_step_is_the_largest_step_the_scheduler_may_plan(max_seqs, tokens, max_model_len):
    plan = profile_plan(max_seqs, tokens, max_model_len, block_size=16)
    lengths = [len(r.token_ids) for r in plan.rows]
    assert len(plan.rows) == max_seqs and all(r.sample for r in plan.rows)
    assert sum(lengths) == min(tokens, max_seqs * (max_model_len - 1)) and 1 <= min(lengths)
    assert max(lengths) < max_model_len
    ids = [b for r in plan.rows for b in r.block_table]
    assert len(ids) == len(set(ids)) and all(len(r.block_table) * 16 >= len(r.token_ids) for r in plan.rows)


def test_too_little_memory_is_one_line_naming_the_flags(tiny_dir):
    model = harness_model(tiny_dir, (GIB // 100, GIB))  # 99% used before the cache
    with pytest.raises(ValueError, match=r"raise --gpu-memory-utilization \(now 0.9\) or lower --max-batched-tokens"):
        gpu_kv_blocks(model, 0.9, max_seqs=4, max_batched_tokens=32, max_model_len=64)
    model.ops.launcher.memory = (GIB, GIB)
    blocks = gpu_kv_blocks(model, 0.9, max_seqs=4, max_batched_tokens=32, max_model_len=64)
    assert blocks * 16 >= 64
    with pytest.raises(ValueError, match="fewer than one request of --max-model-len 10000000; lower --max-model-len"):
        gpu_kv_blocks(model, 0.9, max_seqs=4, max_batched_tokens=32, max_model_len=10_000_000)


def test_running_out_of_memory_in_the_profiling_step_says_which_flags_to_lower(tiny_dir, monkeypatch):
    model = harness_model(tiny_dir, (GIB, GIB))

    def out_of_memory(*args):
        raise MemoryError("Out of memory allocating 1,073,741,824 bytes")

    monkeypatch.setattr(model.ops.launcher, "linear", out_of_memory)
    with pytest.raises(ValueError, match=r"^out of GPU memory in the profiling step \(Out of memory allocating"
                                         r" 1,073,741,824 bytes\); lower --max-batched-tokens \(32\) and --max-seqs"):
        gpu_kv_blocks(model, 0.9, max_seqs=4, max_batched_tokens=32, max_model_len=64)


class CountedUploads(CpuLauncher):
    """The bytes each copy up moves."""

    def __init__(self):
        super().__init__()
        self.uploaded: list[int] = []

    def upload(self, device, host):
        self.uploaded.append(host.nbytes)
        return super().upload(device, host)


def test_a_replay_uploads_the_block_tables_of_its_graphs_rows_only(tiny_dir):
    """At a long context the tables of every graph row are megabytes; a step copies the fields
    and the tables of the rows its graph reads, and still gives the eager step's logits."""
    launcher = CountedUploads()
    graphed = ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=CudaOps(np, launcher))
    eager = ModelRunner.from_dir(tiny_dir, num_blocks=64, block_size=4, ops=cuda_ops("cpu"))
    graphed.capture_graphs(16, 1024)  # 256 table columns a row
    graphs, blocks = graphed.graphs, Blocks(eager)
    width, fields = graphs.width, len(graphs.FIELDS) * graphs.sizes[-1] * 4
    for n in (1, 3, 9):
        prompts = {rid: [5 + i, 9, 3] for i, rid in enumerate("abcdefghi"[:n])}
        for rid, ids in prompts.items():
            plan = StepPlan([Row(rid, ids, 0, blocks.table(rid, 3), sample=True)])
            for r in (graphed, eager):
                r.logits(plan)
        launcher.uploaded.clear()
        plan = StepPlan([Row(rid, [7], 3, blocks.table(rid, 4), sample=True) for rid in prompts])
        got, want = (r.ops.to_host(r.logits(plan)) for r in (graphed, eager))
        assert rel_err(got, want) < 1e-5
        assert launcher.uploaded == [fields, graphs.padded_size(n) * width * 4]
