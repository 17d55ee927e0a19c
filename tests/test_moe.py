"""Mixtures of experts (issue 28): experts multiplied as grouped GEMMs, one per expert a step
and never one per token, on every backend; routing as transformers routes; and a routed row's
logits the same bits alone and in a batch on the packed CPU path. Parity of each family with
transformers is tests/test_families.py's."""

import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from model.ops import numba_ops
from model.ops.cuda_ops import CudaOps
from model.ops.moe import route
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.quant.strips import Strips
from model.runner import ModelRunner, Row, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from family_models import make_family  # noqa: E402

ROWS = 64
BLOCK = 4


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """8 experts, 3 a token; layer 0 routed, layer 1 dense."""
    return make_family("qwen3-moe", tmp_path_factory.mktemp("qwen3-moe"))[0]


def prefilled(path, ops, rows: int = ROWS) -> ModelRunner:
    """rows requests, each its own blocks and a prompt of 1-12 tokens, prefilled in one step."""
    runner = ModelRunner.from_dir(path, num_blocks=ROWS * 8, block_size=BLOCK, ops=ops, max_model_len=32)
    runner.logits(StepPlan([Row(i, prompt(i), 0, row.block_table, sample=True)
                            for i, row in enumerate(decode_rows(rows))]))
    return runner


def prompt(i: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(i).integers(3, 256, 1 + i % 12)]


def decode_rows(rows: int = ROWS) -> list[Row]:
    return [Row(i, [5 + i], len(prompt(i)), list(range(8 * i, 8 * i + 8)), sample=True) for i in range(rows)]


def test_a_batch_of_64_decode_rows_calls_each_experts_gemm_once(qwen3_moe, monkeypatch):
    """Counted on the reference backend: in the routed layer, each expert that any of the 64
    rows chose has its gate/up GEMM and its down GEMM called once (all 8 are chosen: 192
    routed rows), none for an expert no row chose, and the dense layer has none."""
    ops = NumpyOps()
    runner = prefilled(qwen3_moe, ops)
    experts = runner.model.w.layers[0].experts
    assert runner.model.w.layers[1].experts is None and experts.count == 8 and experts.top_k == 3
    calls = []
    linear = ops.linear

    def counted(x, w, bias=None):
        for name in ("gate_up", "down"):
            stack = getattr(experts, name)
            if isinstance(w, np.ndarray) and w.base is stack:
                offset = w.__array_interface__["data"][0] - stack.__array_interface__["data"][0]
                calls.append((name, offset // w.nbytes, x.shape[0]))
        return linear(x, w, bias)

    monkeypatch.setattr(ops, "linear", counted)
    runner.logits(StepPlan(decode_rows()))
    for name in ("gate_up", "down"):
        mine = [(e, rows) for n, e, rows in calls if n == name]
        assert sorted(e for e, _ in mine) == list(range(8)), name  # each expert once
        assert sum(rows for _, rows in mine) == ROWS * 3  # every routed row, in 8 GEMMs
    assert len(calls) == 16


def test_the_packed_experts_are_one_kernel_call_a_projection(qwen3_moe, monkeypatch):
    """On q8_0 the experts are packed and every expert's rows go through one grouped kernel call
    per projection per routed layer, whatever the batch."""
    runner = prefilled(qwen3_moe, NumbaOps("q8_0"))
    experts = runner.model.w.layers[0].experts
    assert isinstance(experts.gate_up, Strips) and isinstance(experts.down, Strips)
    assert experts.router.dtype == np.float32
    calls = []
    grouped = numba_ops.grouped_gemv

    def counted(x, w, *args):
        calls.append(x.shape[0])
        return grouped(x, w, *args)

    monkeypatch.setattr(numba_ops, "grouped_gemv", counted)
    runner.logits(StepPlan(decode_rows()))
    assert calls == [ROWS * 3, ROWS * 3]
    calls.clear()
    runner.logits(StepPlan(decode_rows()[:1]))
    assert calls == [3, 3]


def test_a_routed_rows_logits_are_the_same_bits_alone_and_in_a_batch(qwen3_moe):
    """q8_0: request 0's decode logits alone, among 63 others, and among 15."""
    runner = prefilled(qwen3_moe, NumbaOps("q8_0"))
    rows = decode_rows()
    alone = runner.logits(StepPlan(rows[:1]))[0]
    np.testing.assert_array_equal(runner.logits(StepPlan(rows))[0], alone)
    np.testing.assert_array_equal(runner.logits(StepPlan(rows[:16][::-1]))[-1], alone)


@pytest.mark.parametrize("backend", ["float32", "q8_0", "cuda-harness"])
def test_every_backend_routes_as_the_reference(qwen3_moe, backend):
    """A batch of decode rows against the reference (64; 16 through the slow CPU harness):
    float32 on the CPU and the CUDA kernels (float32 through the harness) within float32's
    rounding in every row; q8_0 within its rounding (2-4%) in nearly every row, where a token
    whose rounded router logits change its choice of expert may stray further, as in any
    quantized mixture."""
    rows = 16 if backend == "cuda-harness" else ROWS
    reference = prefilled(qwen3_moe, NumpyOps(), rows).logits(StepPlan(decode_rows(rows)))
    ops = CudaOps(np, CpuLauncher()) if backend == "cuda-harness" else NumbaOps(backend)
    runner = prefilled(qwen3_moe, ops, rows)
    got = ops.to_host(runner.logits(StepPlan(decode_rows(rows))))
    err = np.abs(got - reference).max(axis=1) / np.abs(reference).max(axis=1)
    if backend == "q8_0":
        assert np.median(err) < 3e-2 and (err < 5e-2).sum() >= rows - 4, np.sort(err)[-8:]
    else:
        assert err.max() < 1e-5, err.max()


def test_routing_is_transformers_top_k():
    """Softmax, the k largest (ties to the lower id), renormalised only where asked; rows
    sorted by expert, each token's rows in its order of choice."""
    logits = np.array([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    plain, normal = route(logits, 2, False), route(logits, 2, True)
    np.testing.assert_allclose(plain.weights, [[probs[0, 1], probs[0, 3]], [probs[1, 0], probs[1, 3]]], rtol=1e-6)
    np.testing.assert_allclose(normal.weights.sum(1), 1.0, rtol=1e-6)
    assert plain.starts.tolist() == [0, 1, 2, 2, 4] and plain.active.tolist() == [0, 1, 3]
    assert plain.tokens.tolist() == [1, 0, 0, 1]  # expert 0: token 1; 1: token 0; 3: tokens 0, 1


def test_captured_decode_graphs_replay_the_experts(qwen3_moe):
    """The CUDA kernels' experts in decode graphs (through the harness's graph stand-in): a
    replayed step of 5 rows (padded to 6, the padding routed too) gives the eager logits."""
    graphed, eager = (ModelRunner.from_dir(qwen3_moe, num_blocks=64, block_size=BLOCK,
                                           ops=CudaOps(np, CpuLauncher()), max_model_len=32) for _ in range(2))
    graphed.capture_graphs(6, 32)
    rows = [Row(i, prompt(i), 0, list(range(8 * i, 8 * i + 8)), sample=True) for i in range(5)]
    for runner in (graphed, eager):
        runner.logits(StepPlan(rows))  # prefill, eager in both
    replays = graphed.graphs.replays
    decode = StepPlan(decode_rows()[:5])
    got, want = (r.ops.to_host(r.logits(decode)) for r in (graphed, eager))
    assert graphed.graphs.replays == replays + 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
