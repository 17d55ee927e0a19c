"""The tiny model's whole forward pass through the CUDA kernels, on the CPU harness behind the
launcher interface cupy_ops uses (and through CuPy on a GPU), against the NumPy backend: prefill (whole prompts and a chunk
on a cached prefix) and decode steps, GEMMs on both sides by the same BLAS.

Tolerance: 1e-5 of the largest logit. Both sides run in float32, but the kernels sum in another
order than NumPy (warp trees, online softmax), so the two differ by float32 rounding per op:
measured 3e-7 to 5e-7 here, with or without the decode split. A wrong mask or slot moves logits
by far more."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher, gpu_available
from model.ops.cuda_ops import CudaOps
from model.runner import ModelRunner, Row, StepPlan
from test_model import Blocks, rel_err


def cuda_ops(backend: str) -> CudaOps:
    if backend == "cpu":
        return CudaOps(np, CpuLauncher())
    if not gpu_available():
        pytest.skip("no GPU: CuPy is not installed or sees no device")
    from model.ops import cupy_ops

    return cupy_ops.create()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_tiny_model_forward_through_the_kernels_matches_numpy(tiny_dir, backend):
    runners = [ModelRunner.from_dir(tiny_dir, num_blocks=64),
               ModelRunner.from_dir(tiny_dir, num_blocks=64, ops=cuda_ops(backend))]
    blocks = Blocks(runners[0])
    rng = np.random.default_rng(0)
    prompts = {"a": rng.integers(3, 390, 37).tolist(), "b": rng.integers(3, 390, 20).tolist(),
               "c": rng.integers(3, 390, 50).tolist()}
    steps = [  # (request, tokens, start position): the rows of each step
        [("a", prompts["a"], 0), ("b", prompts["b"], 0), ("c", prompts["c"][:24], 0)],
        [("a", [7], 37), ("b", [8], 20), ("c", prompts["c"][24:], 24)],  # decode rows and a chunk
        [("a", [9], 38), ("b", [10], 21), ("c", [11], 50)],  # all decode: the split-context kernel
    ]
    for rows in steps:
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        want, got = (r.ops.to_host(r.logits(plan)) for r in runners)
        assert got.shape == want.shape and rel_err(got, want) < 1e-5, rel_err(got, want)


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
    assert set(results) == {"copy", "rms_norm", "decode_attention"}
    assert all(r["seconds"] > 0 and r["bytes"] > 0 for r in results.values())
