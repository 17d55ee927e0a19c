"""The tiny model's whole forward pass through the CUDA kernels, on the CPU harness behind the
launcher interface cupy_ops uses (and through CuPy on a GPU), against the NumPy backend: prefill
(whole prompts and a chunk on a cached prefix) and decode steps, GEMMs on both sides by the same
BLAS; then the scheduler driving a runner on the kernels, sampling on the "device" included.

Tolerance, relative to the largest logit. In float32: 1e-5. Both sides run in float32, but the
kernels sum in another order than NumPy (warp trees, online softmax), so the two differ by
float32 rounding per op: measured 3e-7 to 8e-7 here, with or without the decode split. A wrong
mask or slot moves logits by far more. In float16 and bfloat16 the kernels round weights and
every activation to 11 and 8 significant bits, and the NumPy oracle does not: measured 1.3e-3 to
2.6e-3 (float16) and 0.9e-2 to 1.5e-2 (bfloat16); the bounds are about 3x those."""

TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 4e-2}

import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_harness import CpuLauncher, gpu_available
from engine_harness import Harness
from model.ops.cuda_ops import CudaOps
from model.ops.numpy_ops import NumpyOps
from model.ops.protocol import SampleBatch
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from test_model import Blocks, rel_err


def cuda_ops(backend: str, dtype: str = "float32") -> CudaOps:
    if backend == "cpu":
        return CudaOps(np, CpuLauncher(), dtype)
    if not gpu_available():
        pytest.skip("no GPU: CuPy is not installed or sees no device")
    from model.ops import cupy_ops

    return cupy_ops.create(dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_tiny_model_forward_through_the_kernels_matches_numpy(tiny_dir, backend, dtype):
    assert_forward_matches_numpy(tiny_dir, cuda_ops(backend, dtype), TOLERANCE[dtype])


def test_a_qk_norm_models_forward_through_the_kernels_matches_numpy(tmp_path):
    """Qwen3's tiny model, its q/k norms fused into the rotary K/V write, against NumPy's, as the
    tiny Llama above, in float32 (the tightest bound; the fused kernel's 16-bit rounding is
    test_kernels' rms_norm then rotary, bit for bit)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from family_models import make_family

    runner = assert_forward_matches_numpy(make_family("qwen3-yarn", tmp_path)[0], cuda_ops("cpu"), TOLERANCE["float32"])
    assert runner.model.w.layers[0].q_norm is not None


def assert_forward_matches_numpy(path, ops, tolerance: float):
    """Prefill (whole prompts and a chunk on a cached prefix) and decode steps of the model at
    path through ops, each step's logits against the NumPy backend's; the runner on ops."""
    runners = [ModelRunner.from_dir(path, num_blocks=64), ModelRunner.from_dir(path, num_blocks=64, ops=ops)]
    blocks = Blocks(runners[0])
    rng = np.random.default_rng(0)
    top = min(390, runners[0].model.config.vocab_size)
    prompts = {"a": rng.integers(3, top, 37).tolist(), "b": rng.integers(3, top, 20).tolist(),
               "c": rng.integers(3, top, 50).tolist()}
    steps = [  # (request, tokens, start position): the rows of each step
        [("a", prompts["a"], 0), ("b", prompts["b"], 0), ("c", prompts["c"][:24], 0)],
        [("a", [7], 37), ("b", [8], 20), ("c", prompts["c"][24:], 24)],  # decode rows and a chunk
        [("a", [9], 38), ("b", [10], 21), ("c", [11], 50)],  # all decode: the split-context kernel
    ]
    for rows in steps:
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        want, got = (r.ops.to_host(r.logits(plan)) for r in runners)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert rel_err(got, want) < tolerance, rel_err(got, want)
    return runners[1]


PENALIZED = [  # (sampling, min_tokens): every path of the device sampler, greedy so both backends agree
    (SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3), 0),
    (SamplingParams(temperature=0.0, presence_penalty=1.2, frequency_penalty=0.7, logit_bias={42: 2.0}), 0),
    (SamplingParams(temperature=0.0, logprobs=0), 4),  # min_tokens: stop tokens banned by logit bias
    (SamplingParams(temperature=0.0, frequency_penalty=-0.5), 0),
]


def serve(runner, tok, prompts, **config):
    h = Harness(runner, tok, **config)
    rids = [h.submit(p, sampling=sampling, min_tokens=min_tokens, max_tokens=14)
            for p, (sampling, min_tokens) in zip(prompts, PENALIZED)]
    h.run()
    return [h.tokens(r) for r in rids], [[lp for f in h.frames[r] for lp in f.logprobs or []] for r in rids], h


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_scheduler_on_the_kernels_generates_what_numpy_does(tiny_dir, backend):
    """Greedy tokens with penalties, bias and min_tokens equal the NumPy backend's, logprobs agree
    to 1e-4, through preemption by recompute (penalty counts then survive the request's
    re-prefill), and every request's device slot is free at the end."""
    tok = Tokenizer(tiny_dir)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 390, n).tolist() for n in (9, 23, 5, 14)]
    config = dict(num_blocks=16, block_size=4)
    want_tokens, want_logprobs, _ = serve(ModelRunner.from_dir(tiny_dir, **config), tok, prompts, immunity_tokens=2)
    ops = cuda_ops(backend)
    tokens, logprobs, h = serve(ModelRunner.from_dir(tiny_dir, ops=ops, **config), tok, prompts, immunity_tokens=2)
    assert h.stats.preemptions > 0
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert [(t, [i for i, _ in top]) for t, _, top in got] == [(t, [i for i, _ in top]) for t, _, top in want]
        np.testing.assert_allclose([lp for _, lp, _ in got], [lp for _, lp, _ in want], atol=1e-4)
    assert ops.sampler.fills == sum(s.penalized for s, _ in PENALIZED)  # then counted on the device only
    assert not ops.sampler.slots and len(ops.sampler.free) >= 3


def test_a_row_whose_logits_overflow_fails_its_request_alone(tiny_dir):
    """A row with no finite logit samples no token (-1 on the device). The overlapped loop has
    already fed it to the next step's embedding when the host sees it: that step must run
    (zeros, not an illegal address that would poison every later step), the request must end
    with an error, and the others must generate what they do without it."""
    tok = Tokenizer(tiny_dir)
    rng = np.random.default_rng(2)
    prompts = {rid: rng.integers(3, 390, n).tolist() for rid, n in (("a", 9), ("bad", 12), ("c", 6))}
    params = {"a": SamplingParams(temperature=0.0),
              "bad": SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=2),
              "c": SamplingParams(temperature=0.8, seed=3)}

    def run(poison: bool):
        runner = ModelRunner.from_dir(tiny_dir, num_blocks=32, block_size=4, ops=CudaOps(np, CpuLauncher()))
        assert runner.overlaps
        forward = runner.forward

        def poisoned_forward(plan):
            out, hidden = forward(plan)
            sampling = [r for r in plan.rows if r.sample]
            for i, r in enumerate(sampling):
                if poison and r.request_id == "bad" and len(r.output_ids) >= 2:
                    out[i] = np.nan
            return out, hidden
        runner.forward = poisoned_forward
        h = Harness(runner, tok)
        for rid, prompt in prompts.items():
            h.submit(prompt, request_id=rid, sampling=params[rid], max_tokens=8)
        h.run()
        return h

    clean, poisoned = run(False), run(True)
    last = poisoned.frames["bad"][-1]
    assert last.finish_reason == "error" and "no finite value" in last.error
    got = poisoned.tokens("bad")  # the tokens before the poisoned step (one more, overlapped)
    assert 2 <= len(got) < 8 and got == clean.tokens("bad")[:len(got)]
    for rid in ("a", "c"):
        assert poisoned.tokens(rid) == clean.tokens(rid) and len(clean.tokens(rid)) == 8
    assert poisoned.pool.used == 0  # no block lost with the failed request
    assert not poisoned.runner.ops.sampler.slots


def test_prefill_runs_on_tensor_cores_and_falls_back_if_they_do_not_compile(tiny_dir, caplog):
    """bf16 prefill goes through the WMMA kernel; where its file does not compile (a CUDA install
    without <mma.h>), the CUDA-core kernel takes over with one warning, and the logits agree."""
    class NoMma(CpuLauncher):
        def function(self, file, expression):
            if file == "prefill_attention_tc.cu":
                raise RuntimeError("catastrophic error: cannot open source file \"mma.h\"")
            return super().function(file, expression)

    rng = np.random.default_rng(4)
    logits, launched = [], []
    for launcher in (CpuLauncher(), NoMma()):
        function = launcher.function
        launcher.function = lambda file, expression, f=function: (launched.append(file), f(file, expression))[1]
        runner = ModelRunner.from_dir(tiny_dir, num_blocks=32, ops=CudaOps(np, launcher, "bfloat16"))
        blocks = Blocks(runner)
        prompt = rng.integers(3, 390, 30).tolist() if not logits else prompt
        for _ in range(2):  # the warning once, not per step
            plan = StepPlan([Row("a", prompt, 0, blocks.table("a", 30), sample=True)])
            logits.append(runner.ops.to_host(runner.logits(plan)))
    assert launched.count("prefill_attention_tc.cu") >= 2 and "prefill_attention.cu" in launched
    assert len([r for r in caplog.records if "stays on CUDA cores" in r.message]) == 1
    assert rel_err(logits[2], logits[0]) < TOLERANCE["bfloat16"]


def test_the_device_sampler_refills_a_slot_whose_history_moved_on(tiny_dir):
    """Counts are kept per request; if the history the engine hands over is not the one counted
    (a step failed after sampling), the slot is rebuilt rather than trusted."""
    ops = CudaOps(np, CpuLauncher())
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((1, 300)) * 2).astype(np.float32)
    p = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    history = [int(np.argmax(logits))] * 3
    ops.sample(logits, SampleBatch(p, [[1]], [history[:1]], rng, keys=["r"]))
    got = ops.sample(logits, SampleBatch(p, [[1]], [history], rng, keys=["r"])).token_ids  # two tokens it never counted
    assert ops.sampler.fills == 2
    want = NumpyOps().sample(logits, SampleBatch(p, [[1]], [history], rng)).token_ids
    assert int(got[0]) == int(want[0]) != history[0]


def test_the_kernel_benchmark_runs_through_the_harness(tmp_path):
    """tools/bench_kernels.py is what a GPU session runs first; its --backend cpu --small mode
    checks the script itself (every launch, every shape) without one."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "tools/bench_kernels.py", "--backend", "cpu", "--small", "--json", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"copy", "rms_norm", "decode_attention", "prefill_attention", "prefill_attention_tc"}
    assert all(r["seconds"] > 0 and r["bytes"] > 0 for r in results.values())


def test_a_bfloat16_cache_spills_and_reloads_bit_for_bit(tiny_dir):
    """K/V in bfloat16 (uint16 bits) go to the host spill pool and come back unchanged, under
    other block ids."""
    from model.config import ModelConfig
    from model.kv_cache import KVCache

    ops = CudaOps(np, CpuLauncher(), "bfloat16")
    cache = KVCache(ops, ModelConfig.load(tiny_dir), num_blocks=8, block_size=4)
    rng = np.random.default_rng(2)
    for k in cache.k + cache.v:
        k[...] = rng.integers(0, 1 << 16, k.shape, dtype=np.uint16)
    saved = cache.save_blocks([1, 6])
    cache.load_blocks([3, 0], saved)
    assert saved.dtype == np.uint16
    for k in cache.k + cache.v:
        assert np.array_equal(k[:, [3, 0]], k[:, [1, 6]])


def test_a_spill_holds_its_own_size_on_the_device_not_three_times_it(tiny_dir):
    """The spill pool's gather, measured by tracemalloc (NumPy reports its buffers to it): the
    blocks' K and V come out block-major and equal to the cache's, and the peak while gathering
    is their size plus about one layer's, not the stacked copies' three times."""
    import tracemalloc

    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from model.swap import SwapPool

    config = ModelConfig.load(tiny_dir)
    cache = KVCache(CudaOps(np, CpuLauncher()), config, num_blocks=40, block_size=4)
    rng = np.random.default_rng(3)
    for k in cache.k + cache.v:
        k[...] = rng.standard_normal(k.shape)
    pool = SwapPool(cache, num_slots=32)
    blocks = list(range(3, 35))
    tracemalloc.start()
    spill = pool.save(blocks)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    size = spill.gathered.nbytes
    assert np.array_equal(pool.host[spill.slots], cache.gather_blocks(blocks))
    assert peak < size * (1 + 1.5 / config.num_layers), (peak, size)


@pytest.mark.parametrize("checkpoint,asked,expected,kv", [
    ("float16", "auto", "float16", "f16"), ("bfloat16", "auto", "bfloat16", "f16"), (None, "auto", "bfloat16", "f16"),
    ("float16", "float32", "float32", "f16"), ("bfloat16", "auto", "bfloat16", "fp8")])  # fp8: --kv-cache-dtype fp8
def test_the_cuda_backend_loads_in_the_checkpoint_dtype_unless_told(tiny_dir, tmp_path, monkeypatch,
                                                                     checkpoint, asked, expected, kv):
    """--backend cuda resolved and loaded as serve does, with CuPy stood in for by the harness."""
    import json
    import shutil
    import sys
    import types

    import model.ops
    from model.backend import resolve

    standin = types.SimpleNamespace(available=lambda: True, create=lambda dtype, kv: CudaOps(np, CpuLauncher(), dtype, kv))
    monkeypatch.setitem(sys.modules, "model.ops.cupy_ops", standin)
    monkeypatch.setattr(model.ops, "cupy_ops", standin, raising=False)
    path = shutil.copytree(tiny_dir, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    if checkpoint:
        config["torch_dtype"] = checkpoint
    (path / "config.json").write_text(json.dumps(config))
    backend = resolve("auto", asked, kv)
    llama = backend.load(path)
    assert backend.name == "cuda" and backend.dtype == expected
    assert llama.w.embed.dtype == {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[expected]
    runner = ModelRunner(llama.config, llama, num_blocks=8, block_size=4)
    assert runner.cache.k[0].dtype == (np.uint8 if kv == "fp8" else llama.w.embed.dtype)
    assert runner.step(StepPlan([Row("r", [5, 6, 7], 0, [0], sample=True)]))[0].token_id >= 0


def test_the_device_sampler_applies_a_grammar_mask():
    """Greedy and sampled rows on the kernels pick only what a grammar allows (the favourite is
    masked out), penalised rows too, and logprobs stay those of the raw logits."""
    ops = CudaOps(np, CpuLauncher())
    rng = np.random.default_rng(12)
    vocab = 256
    logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
    allowed = rng.random((3, vocab)) < 0.1
    allowed[np.arange(3), np.argmax(logits, axis=1)] = False
    masks = [None if r == 2 else np.packbits(allowed[r], bitorder="little").view(np.int32) for r in range(3)]
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0)]
    for _ in range(10):
        got = ops.sample(logits, SampleBatch(params, [[1]] * 3, [[]] * 3, rng, masks=masks))
        ids, logprobs = got.token_ids, got.logprobs
        assert allowed[0, ids[0]] and allowed[1, ids[1]] and ids[2] == np.argmax(logits[2])
    want = NumpyOps().sample(logits, SampleBatch(params, [[1]] * 3, [[]] * 3, rng, masks=masks)).logprobs
    assert logprobs[0] == pytest.approx(want[0], abs=1e-5)
