"""GGUF weights kept packed on the device (cuda/dequant_gemv.cu, model/ops/cuda_quant.py), through
the CPU harness, against gguf-py's NumPy dequantizer (model/quant/quantized.dequantize).

The blocks are random bytes with sane float16 scales, so every code, every 6-bit scale and
minimum and every high bit pattern occurs. Tolerances, relative to the largest output: the
kernel's fp32 sums against float64 differ by float32 rounding (measured under 2e-7); the 16-bit
outputs by their own rounding (bf16 measured 2e-3 to 3.3e-3, fp16 2e-4 to 3e-4). The kernel tests
run through CuPy too where a GPU is present (tools/device_check.sh)."""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cuda_harness import CpuLauncher, as_float, poisoned, storage
from model.memory import model_weight_bytes, planned_weight_bytes
from model.ops import cuda_quant
from model.ops.cuda_ops import CudaOps
from model.ops.kernels import PACKED_TYPES
from model.ops.numpy_ops import NumpyOps
from model.quant import e4m3, int4, kquants
from model.quant.quantized import Fused, QuantizedTensor, dequantize
from test_kernels import ULP, launcher  # noqa: F401 (launcher: the fixture, CPU harness and GPU)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import make_model  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
TOLERANCE = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}
# each type's float16 fields (byte offset in its block): scales, and minimums where it has them
HALVES = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
          "int4_32": (0,), "int4_128": (0,)}


def random_blocks(kind: str, rows: int, columns: int, seed: int = 0) -> QuantizedTensor:
    """Random bytes, sane float16 scales; an int4 block's zero an integer 0..16, as the loader's;
    an e4m3 block's float32 scale and every code but NaN's."""
    rng = np.random.default_rng(seed)
    if kind in e4m3.KINDS:
        values = e4m3.KINDS[kind]
        codes = rng.integers(0, 256, (rows, columns), dtype=np.uint8)
        codes[(codes & 0x7f) == 0x7f] -= 1  # NaN's codes: 0x7e, the largest finite (448)
        scales = rng.uniform(-2, 2, (rows, columns // values)).astype(np.float32) / 448
        return QuantizedTensor(kind, e4m3.to_blocks(kind, codes, scales), (rows, columns))
    if kind in int4.KINDS:
        values, size = int4.KINDS[kind], int4.block_bytes(kind)
    else:
        values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.upper()]]
    blocks = rng.integers(0, 256, (rows, columns // values, size), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = rng.uniform(-0.02, 0.02, (rows, columns // values, 1)).astype(np.float16)
        blocks[:, :, at:at + 2] = halves.view(np.uint8)
    if kind in int4.KINDS:
        zeros = rng.integers(0, 17, (rows, columns // values, 1)).astype(np.float16)
        blocks[:, :, 2:4] = zeros.view(np.uint8)
    return QuantizedTensor(kind, blocks.reshape(rows, -1), (rows, columns))


def odd_width(kind: str) -> int:
    """9 blocks of 32 (a step and a part-filled one), 3 super-blocks, or 5 blocks of 128."""
    return 640 if kind.endswith("_128") else 768 if kind.endswith("_k") else 288


def close(got, want, dtype: str) -> None:
    scale = np.abs(want).max()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", PACKED_TYPES)
def test_the_gemv_is_the_dequantized_product_and_a_row_is_the_same_in_any_batch(launcher, kind, dtype):
    """Rows 1 to 9 (a second block of rows at 9), 6 weight rows (a part-filled block of 4),
    written at column 2 of a 9-wide output whose other columns stay NaN; with a bias."""
    ops = CudaOps(np, launcher, dtype)
    k = odd_width(kind)
    qt = random_blocks(kind, 6, k)
    w = cuda_quant.packed(ops, qt)
    rng = np.random.default_rng(1)
    x = storage(rng.standard_normal((9, k)), dtype)
    bias = storage(rng.standard_normal(6), dtype)
    want = as_float(x, dtype).astype(np.float64) @ dequantize(qt).T.astype(np.float64) + as_float(bias, dtype)
    outs = {}
    for rows in range(1, 10):
        out = poisoned((rows, 9), dtype)
        cuda_quant.gemv(ops, out, x[:rows], w, bias, 2)
        got = outs[rows] = as_float(out, dtype)
        assert np.isnan(got[:, :2]).all() and np.isnan(got[:, 8:]).all()
        close(got[:, 2:8], want[:rows], dtype)
    for rows in range(1, 9):  # each row's bits, alone or among others
        np.testing.assert_array_equal(outs[rows], outs[9][:rows])
    np.testing.assert_array_equal(outs[8][:, 2:8], as_float(ops.linear(x[:8], w, bias), dtype))  # ops' GEMV
    assert ops.linear(x[:0], w, bias).shape == (0, 6)  # no rows: no launch (a grid of none fails on a GPU)


@pytest.mark.parametrize("kind", PACKED_TYPES)
def test_fp32_logits_from_16_bit_activations(launcher, kind):
    ops = CudaOps(np, launcher, "bfloat16")
    qt = random_blocks(kind, 5, odd_width(kind), seed=2)
    x = storage(np.random.default_rng(3).standard_normal((3, qt.shape[1])), "bfloat16")
    got = ops.logits(x, cuda_quant.packed(ops, qt))
    assert got.dtype == np.float32
    close(got, as_float(x, "bfloat16").astype(np.float64) @ dequantize(qt).T.astype(np.float64), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", PACKED_TYPES)
def test_dequantized_rows_are_the_reference_rounded_once(launcher, kind, dtype):
    """Bit for bit the reference's values in the storage type on the CPU (a GPU's fused multiply-add
    may move one ulp): a range of rows, and an embedding gather whose ids outside the table give
    zeros, times Gemma's scale."""
    ops = CudaOps(np, launcher, dtype)
    qt = random_blocks(kind, 7, odd_width(kind), seed=4)
    w, ref = cuda_quant.packed(ops, qt), dequantize(qt)
    ids = np.array([6, -1, 0, 7, 3], dtype=np.int32)
    pairs = [(cuda_quant.dequantize_rows(ops, w, 2, 4), ref[2:6]),
             (cuda_quant.embedding(ops, w, ids, scale=2.5),
              np.where((ids >= 0)[:, None] & (ids < 7)[:, None], ref[np.clip(ids, 0, 6)] * np.float32(2.5), 0))]
    for got, want in pairs:
        if isinstance(launcher, CpuLauncher):
            np.testing.assert_array_equal(got, storage(want, dtype))
        else:
            np.testing.assert_allclose(as_float(got, dtype), as_float(storage(want, dtype), dtype), rtol=ULP[dtype])


@pytest.mark.parametrize("rows", [3, 11])
def test_a_fused_weight_of_mixed_kinds_in_tiles_matches_numpy(rows, monkeypatch, caplog):
    """A Q4_K_M file's q/k (Q4_K) beside its v (Q6_K) and a type kept as bf16 (Q5_0), with a bias:
    3 rows through the GEMV, 11 through dequantized tiles (three rows a tile here) and the GEMM."""
    monkeypatch.setattr(cuda_quant, "TILE_VALUES", 3 * 256)
    parts = [random_blocks("q4_k", 8, 256, 5), random_blocks("q6_k", 4, 256, 6), random_blocks("q5_0", 5, 256, 7)]
    ops = CudaOps(np, CpuLauncher(), "float32")
    w = ops.weight(Fused(tuple(parts)))
    assert [type(p).__name__ for p in w.parts] == ["PackedWeight", "PackedWeight", "ndarray"]
    assert w.nbytes == parts[0].nbytes + parts[1].nbytes + 5 * 256 * 4
    with caplog.at_level("INFO", logger="spool.model"):
        ops.loaded()
    assert "GGUF types q5_0 have no packed kernels on the GPU; dequantized to float32" in caplog.text
    rng = np.random.default_rng(8)
    x, bias = rng.standard_normal((rows, 256)).astype(np.float32), rng.standard_normal(17).astype(np.float32)
    numpy_ops = NumpyOps()
    want = numpy_ops.linear(x, numpy_ops.weight(Fused(tuple(parts))), bias)
    close(ops.linear(x, w, bias), want, "float32")
    close(cuda_quant.dense(ops, w), numpy_ops.weight(Fused(tuple(parts))), "float32")  # for the MoE's kernels


@pytest.fixture(scope="module")
def q4_k_m_dir(tmp_path_factory):
    """A one-layer llama whose matrices are multiples of 256 wide, quantized as llama-quantize's
    Q4_K_M picks for a first layer: Q6_K v, down and output, Q4_K the rest (the embedding too)."""
    import tiny_gguf
    from model.gguf.convert import convert_gguf

    path = tmp_path_factory.mktemp("q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in dict(HIDDEN=256, FFN=512, LAYERS=1, HEADS=4, KV_HEADS=2).items():
            patch.setattr(tiny_gguf, name, value)
        # gguf-py quantizes to no K-quant; Spool's quantizer writes llama.cpp's bytes
        patch.setattr(gguf.quants, "quantize", kquants.quantize)
        kinds = {name: gguf.GGMLQuantizationType.Q6_K if name.endswith(("v_proj.weight", "down_proj.weight"))
                 or name == "lm_head.weight" else gguf.GGMLQuantizationType.Q4_K
                 for name in tiny_gguf.hf_weights(tied=False, vocab=400)}
        src, _, _ = tiny_gguf.tiny_gguf(path / "m.gguf", tied=False, quant=kinds)
    return convert_gguf(src, path / "model")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_q4_k_m_model_through_the_kernels_matches_numpy_on_the_same_blocks(q4_k_m_dir, dtype):
    """Prefill (more than 8 rows: dequantized tiles and the GEMM) and decode steps (the GEMV),
    against the NumPy backend on the same blocks dequantized; tolerances as test_cuda_forward's
    (measured 8e-7 to 1.1e-6 in float32, 0.9e-2 to 1.2e-2 in bfloat16)."""
    from model.runner import ModelRunner, Row, StepPlan
    from test_cuda_forward import TOLERANCE
    from test_model import Blocks, rel_err

    runners = [ModelRunner.from_dir(q4_k_m_dir, num_blocks=16),
               ModelRunner.from_dir(q4_k_m_dir, num_blocks=16, ops=CudaOps(np, CpuLauncher(), dtype))]
    w = runners[1].model.w
    assert isinstance(w.embed, cuda_quant.PackedWeight) and w.lm_head.kind == "q6_k"
    assert [p.kind for p in w.layers[0].wqkv.parts] == ["q4_k", "q6_k"]  # q and k stacked, v apart
    assert runners[1].model.weight_bytes < 0.4 * runners[0].model.weight_bytes / 2  # against bf16's
    assert runners[1].model.weight_bytes == model_weight_bytes(q4_k_m_dir, dtype)  # as planned before loading
    blocks = Blocks(runners[0])
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(3, 390, n).tolist() for rid, n in (("a", 7), ("b", 5))}
    steps = [[(rid, prompt, 0) for rid, prompt in prompts.items()],
             [("a", [7], 7), ("b", [8], 5)], [("a", [9], 8), ("b", [10], 6)]]
    for rows in steps:
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        want, got = (r.ops.to_host(r.logits(plan)) for r in runners)
        assert rel_err(got, want) < TOLERANCE[dtype], rel_err(got, want)


def test_an_8b_q4_k_m_plans_under_6_gb_of_weights_on_the_gpu():
    """Llama-3.1-8B's tensors as llama-quantize's Q4_K_M types them (tools/make_model.py), no file:
    4.91 GB packed (the real file is 4.92 GB), 16.06 GB had they been dequantized to bf16."""
    shape = make_model.SHAPES["llama3.1-8b"]
    tensors = [(make_model.tensor_type(t, "q4_k_m", shape).name, t.shape) for t in make_model.tensors(shape)]
    assert {kind for kind, _ in tensors} == {"Q4_K", "Q6_K", "F32"}
    assert planned_weight_bytes(tensors, "bfloat16") < 6e9
    assert planned_weight_bytes([("bf16", s) for _, s in tensors], "bfloat16") > 16e9
