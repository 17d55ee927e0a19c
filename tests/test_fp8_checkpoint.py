"""FP8 (e4m3) checkpoints (model/quant/fp8.py), the CPU and harness side: made here from a tiny
model's float weights (scales per tensor, per row, or per 32 x 32 block; codes by test_kv_fp8's
e4m3 reference), read back to e4m3 value x scale exactly, and served through the CUDA kernels and
the CPU against NumPy on those values."""

import json

import numpy as np
import pytest

from model.config import ModelConfig
from model.errors import ModelError
from model.quant import fp8
from model.weights import open_tensors
from test_awq_gptq import assert_steps_match, runner
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


@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
def test_an_fp8_model_reads_back_and_matches_numpy(tmp_path, scales, caplog):
    """The projections read as e4m3 x scale exactly (the scales hidden); through the CUDA harness
    (float32, measured 6e-7 to 1e-6) and the CPU's Q8_0 (2.5e-2 to 3.1e-2: activations, K/V and the
    values rounded again) against NumPy."""
    from cuda_harness import CpuLauncher
    from model.memory import model_weight_bytes
    from model.ops.cuda_ops import CudaOps
    from model.ops.numba_ops import NumbaOps

    path, want = make_fp8_model(tmp_path / scales, scales)
    ModelConfig.load(path)
    with caplog.at_level("INFO", logger="spool.model"), open_tensors(path) as tensors:
        assert not any(name.endswith(fp8.SCALES) for name in tensors.entries)
        for name, values in want.items():
            np.testing.assert_array_equal(tensors.read(name), values)
    assert "FP8 (e4m3) weights" in caplog.text and "dequantized to float32 at load" in caplog.text
    cuda = runner(path, CudaOps(np, CpuLauncher(), "float32"))
    assert cuda.model.weight_bytes == model_weight_bytes(path, "float32")
    assert_steps_match([runner(path), cuda], 1e-5)
    assert_steps_match([runner(path), runner(path, NumbaOps("q8_0"))], 5e-2)


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
