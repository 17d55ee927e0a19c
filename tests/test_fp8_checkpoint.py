"""FP8 (e4m3) checkpoints (model/quant/fp8.py), the CPU and harness side: made here from a tiny
model's float weights (scales per tensor, per row, or per 32 x 32 block; codes by test_kv_fp8's
e4m3 reference), read back as e4m3 blocks (model/quant/e4m3.py) whose values are e4m3 value x
scale exactly, kept packed by the CUDA kernels (cuda/dequant_gemv.cu's FP8_32 and FP8_128) and as
Q8_0 by the CPU, and served against NumPy on those values."""

import json

import numpy as np
import pytest

from model.config import ModelConfig
from model.errors import ModelError
from model.quant import fp8
from model.quant.quantized import QuantizedTensor, float32
from model.weights import open_tensors
from test_awq_gptq import assert_steps_match, llama_8b, runner
from test_kv_fp8 import E4M3, e4m3
from test_loading import write_safetensors
from tiny_model import make_tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 32


def make_fp8_model(path, scales: str):
    """scales: "tensor", "row" or "block" (weight_block_size [32, 32], weight_scale_inv). Returns
    the directory and each projection's values (e4m3 value x scale, float32)."""
    from safetensors.numpy import load_file

    make_tiny_model(path, tie=False, hidden=128, heads=4, kv_heads=2, intermediate=256)
    tensors, want = {}, {}
    for name, w in load_file(str(path / "model.safetensors")).items():
        if name.split(".")[-2] not in LINEARS:
            tensors[name] = ("F32", w)
            continue
        if scales == "block":
            tiles = np.abs(w).reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1] // BLOCK, BLOCK).max(axis=(1, 3))
            scale = (tiles / 448).astype(np.float32)
            full = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)
        else:
            top = np.abs(w).max(axis=1, keepdims=True) if scales == "row" else np.abs(w).max()
            scale = full = (top / 448).astype(np.float32)
        codes = e4m3(w / full)
        want[name] = E4M3[codes] * full
        tensors[name] = ("F8_E4M3", codes)
        tensors[name.replace(".weight", ".weight_scale_inv" if scales == "block" else ".weight_scale")] = \
            ("F32", scale.reshape(-1) if scales == "tensor" else scale)
        tensors[name.replace(".weight", ".input_scale")] = ("F32", np.ones(1, np.float32))
    write_safetensors(path / "model.safetensors", tensors)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"} | (
        {"weight_block_size": [BLOCK, BLOCK]} if scales == "block" else {})
    (path / "config.json").write_text(json.dumps(config))
    return path, want


def test_the_model_s_e4m3_table_is_the_reference_s():
    np.testing.assert_array_equal(fp8.E4M3, E4M3)


@pytest.mark.parametrize("scales,dtype", [("tensor", "float32"), ("row", "bfloat16"), ("block", "float16")])
def test_an_fp8_model_reads_back_and_matches_numpy(tmp_path, scales, dtype, caplog):
    """The projections read as e4m3 blocks of e4m3 x scale exactly (the scales hidden), kept packed
    by the CUDA harness in the bytes planned; through it (prefill via tiles and the GEMM, decode via
    the GEMV; tolerances test_cuda_forward's: float32 measured 6e-7 to 1e-6, bfloat16 1.1e-2 to
    1.6e-2, float16 1.2e-3 to 1.5e-3) and the CPU's Q8_0 (2.5e-2 to 3.1e-2: activations, K/V and
    the values rounded again) against NumPy."""
    from test_cuda_forward import TOLERANCE

    from cuda_harness import CpuLauncher
    from model.memory import model_weight_bytes
    from model.ops.cuda_ops import CudaOps
    from model.ops.cuda_quant import PackedWeight
    from model.ops.numba_ops import NumbaOps

    path, want = make_fp8_model(tmp_path / scales, scales)
    ModelConfig.load(path)
    kind = "fp8_32" if scales == "block" else "fp8_128"  # 32 x 32 blocks' scales change every 32 inputs
    with caplog.at_level("INFO", logger="spool.model"), open_tensors(path) as tensors:
        assert not any(name.endswith(fp8.SCALES) for name in tensors.entries)
        for name, values in want.items():
            assert tensors.quantized(name) and tensors.read(name).kind == kind
            np.testing.assert_array_equal(float32(tensors.read(name)), values)
            out = np.empty_like(values)
            tensors.read_into(name, out)  # the float32 route (fp8.py's dequantization): the same values
            np.testing.assert_array_equal(out, values)
    assert "FP8 (e4m3) weights" in caplog.text and f"kept packed as {kind} blocks" in caplog.text
    cuda = runner(path, CudaOps(np, CpuLauncher(), dtype))
    layer = cuda.model.w.layers[0]
    assert all(isinstance(w, PackedWeight) and w.kind == kind for w in (layer.wqkv, layer.wo, layer.w_down))
    assert cuda.model.weight_bytes == model_weight_bytes(path, dtype)
    assert_steps_match([runner(path), cuda], TOLERANCE[dtype])
    assert_steps_match([runner(path), runner(path, NumbaOps("q8_0"))], 5e-2)


def one_weight(path, layout: str, block=None, shape=(40, 384), seed=0):
    """A directory of one F8_E4M3 weight "w.weight" of every finite code and random scales, per
    tensor ((1,)), row ((out, 1)) or [bo, bi] block; with its values as fp8.py's float32
    dequantization computes them."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7f) == 0x7f] -= 1  # NaN's codes
    if layout == "block":
        scale = rng.uniform(0.5, 2, (-(-shape[0] // block[0]), -(-shape[1] // block[1]))).astype(np.float32) / 448
        full = np.repeat(np.repeat(scale, block[0], axis=0)[:shape[0]], block[1], axis=1)[:, :shape[1]]
    else:
        scale = full = rng.uniform(0.5, 2, (shape[0], 1) if layout == "row" else (1,)).astype(np.float32) / 448
    path.mkdir()
    scale_name = "w.weight_scale_inv" if layout == "block" else "w.weight_scale"
    write_safetensors(path / "model.safetensors", {"w.weight": ("F8_E4M3", codes), scale_name: ("F32", scale)})
    return fp8.FP8Tensors(path, block), E4M3[codes] * full


LAYOUTS = [("tensor", None, "fp8_128"), ("row", None, "fp8_128"), ("block", (16, 32), "fp8_32"),
           ("block", (128, 128), "fp8_128"), ("block", (32, 64), "fp8_32")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout,block,kind", LAYOUTS)
def test_each_scale_layout_through_the_kernels_is_the_float32_weight(tmp_path, monkeypatch, layout, block, kind,
                                                                     dtype):
    """The blocks' values are fp8.py's float32 dequantization bit for bit (40 rows: part-filled
    row blocks of 16 and 128); dequant_rows gives them rounded once to the storage type; 1 to 8
    activation rows through dequant_gemv into columns 2.. of a NaN-poisoned output, 9 and 13
    through dequantized tiles (16 rows a tile) and the GEMM, against float64 on those values
    (tolerances test_dequant_gemv's)."""
    from cuda_harness import CpuLauncher, as_float, poisoned, storage
    from model.ops import cuda_quant
    from model.ops.cuda_ops import CudaOps
    from model.quant import e4m3
    from test_dequant_gemv import close

    tensors, want = one_weight(tmp_path / "m", layout, block)
    with tensors:
        assert tensors.quantized("w.weight") and tensors.entries["w.weight"].dtype == kind
        blocks = tensors.read("w.weight")
    np.testing.assert_array_equal(e4m3.dequantize(blocks), want)
    ops = CudaOps(np, CpuLauncher(), dtype)
    w = ops.weight(blocks)
    assert isinstance(w, cuda_quant.PackedWeight) and w.kind == kind and w.nbytes == blocks.nbytes
    np.testing.assert_array_equal(cuda_quant.dequantize_rows(ops, w, 0, 40), storage(want, dtype))
    monkeypatch.setattr(cuda_quant, "TILE_VALUES", 16 * 384)
    rng = np.random.default_rng(1)
    x, bias = storage(rng.standard_normal((13, 384)), dtype), storage(rng.standard_normal(40), dtype)
    reference = as_float(x, dtype).astype(np.float64) @ want.T.astype(np.float64) + as_float(bias, dtype)
    for rows in (1, 2, 5, 8):
        out = poisoned((rows, 44), dtype)
        cuda_quant.gemv(ops, out, x[:rows], w, bias, 2)
        got = as_float(out, dtype)
        assert np.isnan(got[:, :2]).all() and np.isnan(got[:, 42:]).all()
        close(got[:, 2:42], reference[:rows], dtype)
    for rows in (9, 13):
        out = poisoned((rows, 40), dtype)
        cuda_quant.linear(ops, x[:rows], w, bias, out)
        close(as_float(out, dtype), reference[:rows], dtype)


def test_every_e4m3_code_decodes_in_the_kernel_as_in_the_table(tmp_path):
    """All 256 codes, NaN's two among them, through dequant_rows in float32: the table's values."""
    from cuda_harness import CpuLauncher
    from model.ops import cuda_quant
    from model.ops.cuda_ops import CudaOps
    from model.quant import e4m3

    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scales = np.array([[-0.5], [1.0]], np.float32)
    ops = CudaOps(np, CpuLauncher(), "float32")
    blocks = QuantizedTensor("fp8_128", e4m3.to_blocks("fp8_128", codes, scales), codes.shape)
    got = cuda_quant.dequantize_rows(ops, ops.weight(blocks), 0, 2)
    want = E4M3[codes] * scales
    np.testing.assert_array_equal(got, want)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # 0 x -0.5, -0 x 1: -0
    assert np.isnan(got[:, 127]).all() and finite.sum() == 254 and np.signbit(got[1, 0])


def test_scales_not_one_a_32_inputs_fall_back_to_float32_in_one_line(tmp_path, caplog):
    """Blocks of 48 inputs share no scale across a block of 32: read as float32, fp8.py's values."""
    with caplog.at_level("INFO", logger="spool.model"):
        tensors, want = one_weight(tmp_path / "m", "block", (16, 48))
    with tensors:
        assert not tensors.quantized("w.weight")
        np.testing.assert_array_equal(tensors.read("w.weight"), want)
    assert "1 of 1 weights, whose scales change within 32 inputs, dequantized to float32 at load" in caplog.text


def test_the_cpu_keeps_fp8_blocks_as_it_kept_their_float32_values(tmp_path):
    """The CPU's strips from the blocks are pack.compress's of fp8.py's float32 values (Q8_0):
    what it kept before the blocks were packed."""
    from model.ops.numba_ops import NumbaOps
    from model.quant import pack

    tensors, want = one_weight(tmp_path / "m", "row")
    with tensors:
        got = NumbaOps("q8_0").weight(tensors.read("w.weight"))
    kept = pack.compress(want)
    assert type(got) is type(kept)
    np.testing.assert_array_equal(got.q, kept.q)
    np.testing.assert_array_equal(got.factors, kept.factors)


def test_an_8b_fp8_plans_its_e4m3_blocks():
    """Llama-3.1-8B's shapes as llm-compressor's FP8 checkpoints hold them (projections e4m3, the
    embedding, LM head and norms bfloat16), no file: 9.3 GB planned on the GPU, against 16.1 GB
    had the projections been dequantized to bf16."""
    from model.memory import planned_weight_bytes

    planned = planned_weight_bytes(llama_8b("fp8_128", "BF16"), "bfloat16")
    assert 9.2e9 < planned < 9.4e9
    assert planned_weight_bytes(llama_8b("BF16", "BF16"), "bfloat16") > 16e9


@pytest.mark.parametrize("changes,line", [
    (dict(fmt="e5m2"), "holds FP8 weights in e5m2, which Spool cannot load"),
    (dict(weight_block_size=[128]), "holds FP8 weights in blocks of [128], which Spool cannot load"),
])
def test_an_fp8_variant_not_loaded_is_refused_in_one_line(tmp_path, changes, line):
    path, _ = make_fp8_model(tmp_path / "m", "tensor")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] |= changes
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as refused:
        ModelConfig.load(path)
    assert line in str(refused.value) and "\n" not in str(refused.value)
