"""AWQ and GPTQ int4 checkpoints (model/quant/awq_gptq.py): made here from known float weights by
each format's rule (tests/int4_checkpoints.py), read back to the format's dequantized weights, and
served on the CPU (exact Q8_0 blocks) and through the CUDA kernels (int4 blocks kept packed)
against the NumPy backend on the same dequantized weights."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from int4_checkpoints import make_int4_model
from model.config import ModelConfig
from model.errors import ModelError
from model.quant import awq_gptq
from model.quant.quantized import QuantizedTensor, dequantize
from model.weights import open_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import make_model  # noqa: E402

# (method, group, sym, v1): AWQ in groups of 128 and 32; GPTQ classic asymmetric, symmetric (a
# Qwen2, whose q/k/v biases stay float16 beside the int4 weights), gptq_v2 per channel (-1)
FORMATS = {"awq-128": ("awq", 128, False, True), "awq-32": ("awq", 32, False, True),
           "gptq-64": ("gptq", 64, False, True), "gptq-sym-128": ("gptq", 128, True, True),
           "gptq_v2-row": ("gptq", -1, False, False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return {name: make_int4_model(root / name, method, group, sym, v1, variant="qwen2" if "sym" in name else "llama")
            for name, (method, group, sym, v1) in FORMATS.items()}


@pytest.mark.parametrize("name", FORMATS)
def test_the_loader_reads_the_format_s_dequantized_weights(checkpoints, name, caplog):
    """Every projection read as int4 blocks whose values are the packer's dequantized weights bit
    for bit, and so are the Q8_0 blocks the CPU keeps (gguf-py's dequantizer reads them); one log
    line says how each backend keeps them."""
    path, want = checkpoints[name]
    ModelConfig.load(path)
    with caplog.at_level("INFO", logger="spool.model"), open_tensors(path) as tensors:
        assert f"{FORMATS[name][0].upper()} int4 weights (groups of {FORMATS[name][1]} inputs): kept packed as" \
            in caplog.text and "Q8_0 blocks of the same values on the CPU" in caplog.text
        assert "model.layers.0.self_attn.q_proj.qweight" not in tensors.entries
        for tensor, values in want.items():
            got = tensors.read(tensor)
            assert isinstance(got, QuantizedTensor) and got.kind == ("int4_32" if "32" in name or "64" in name
                                                                      else "int4_128")
            np.testing.assert_array_equal(dequantize(got), values)
            np.testing.assert_array_equal(dequantize(awq_gptq.to_q8_0(got)), values)
        assert tensors.read("lm_head.weight").dtype == np.float32  # float16 in the file, as AWQ keeps it
        assert ("model.layers.0.self_attn.q_proj.bias" in tensors.entries) == ("sym" in name)  # Qwen2's


def test_the_cpu_keeps_exact_q8_0_blocks_and_matches_numpy(checkpoints):
    """Prefill and two decode steps on NumbaOps("q8_0") against NumPy on the dequantized weights:
    the projections' strips read back exactly; the logits differ by the activations' rounding, the
    float16 K/V and the float16 embedding and LM head rounded to Q8_0 (measured 1.9e-2 to 3.4e-2
    over the five formats)."""
    from model.ops.numba_ops import NumbaOps
    from model.quant.strips import Q8_0Strips

    path, want = checkpoints["awq-128"]
    runners = [runner(path), runner(path, NumbaOps("q8_0"))]
    wqkv = runners[1].model.w.layers[0].wqkv
    assert isinstance(wqkv, Q8_0Strips)
    q = want["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(wqkv.dequantize(np.arange(q.shape[0]))[:, :q.shape[1]], q)
    assert_steps_match(runners, 5e-2)


@pytest.mark.parametrize("name,dtype", [("awq-128", "float32"), ("gptq-64", "bfloat16"), ("gptq-sym-128", "float16")])
def test_an_int4_model_through_the_cuda_kernels_matches_numpy(checkpoints, name, dtype):
    """Kept packed on the device (int4 blocks, the bytes planned before loading): the prefill's 16
    rows through dequantized tiles and the GEMM, the decode steps' 2 through dequant_gemv, against
    NumPy on the dequantized weights, within test_cuda_forward's tolerances (measured over the
    five formats: float32 6.5e-7 to 1.2e-6, float16 1e-3 to 1.7e-3, bfloat16 0.8e-2 to 1.7e-2)."""
    from cuda_harness import CpuLauncher
    from model.memory import model_weight_bytes
    from model.ops.cuda_ops import CudaOps
    from model.ops.cuda_quant import PackedWeight
    from test_cuda_forward import TOLERANCE

    path, _ = checkpoints[name]
    runners = [runner(path), runner(path, CudaOps(np, CpuLauncher(), dtype))]
    w = runners[1].model.w.layers[0]
    assert isinstance(w.wqkv, PackedWeight) and w.wqkv.kind == ("int4_32" if name == "gptq-64" else "int4_128")
    assert runners[1].model.weight_bytes == model_weight_bytes(path, dtype)
    assert_steps_match(runners, TOLERANCE[dtype])


def runner(path, ops=None):
    """The checkpoint on ops (NumPy where None)."""
    from model.runner import ModelRunner

    return ModelRunner.from_dir(path, num_blocks=16, ops=ops)


def assert_steps_match(runners, tolerance: float) -> None:
    """A prefill of two prompts, then two decode steps: each runner's logits against the first's."""
    from model.runner import Row, StepPlan
    from test_model import Blocks, rel_err

    blocks = Blocks(runners[0])
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(3, 390, n).tolist() for rid, n in (("a", 11), ("b", 5))}
    steps = [[(rid, prompt, 0) for rid, prompt in prompts.items()],
             [("a", [7], 11), ("b", [8], 5)], [("a", [9], 12), ("b", [10], 6)]]
    for rows in steps:
        plan = StepPlan([Row(rid, ids, start, blocks.table(rid, start + len(ids)), sample=True)
                         for rid, ids, start in rows])
        want, *others = (np.asarray(r.ops.to_host(r.logits(plan)), np.float64) for r in runners)
        for got in others:
            assert rel_err(got, want) < tolerance, rel_err(got, want)


def with_quantization(path, tmp_path, **changes):
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] |= changes
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("name,changes,line", [
    ("gptq-64", dict(bits=8), "holds GPTQ weights of 8 bits, which Spool cannot load"),
    ("awq-128", dict(bits=3), "holds AWQ weights of 3 bits, which Spool cannot load"),
    ("gptq-64", dict(checkpoint_format="marlin"), "holds GPTQ weights in the marlin layout"),
    ("awq-128", dict(version="gemv"), "holds AWQ weights packed for AWQ's gemv kernels"),
    ("awq-128", dict(quant_method="hqq"), "holds HQQ weights (quantization_config in config.json), which Spool"
                                          " cannot load"),
])
def test_what_cannot_load_is_refused_in_one_line(checkpoints, tmp_path, name, changes, line):
    path = with_quantization(checkpoints[name][0], tmp_path, **changes)
    with pytest.raises(ModelError) as refused:
        ModelConfig.load(path)
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_an_act_order_model_loads_dequantized_and_matches_numpy(tmp_path, caplog):
    """GPTQ's desc_act: g_idx scatters each group along the input, so the weights are read as
    float32 (the packer's dequantized values, exactly) and kept as float weights: the same logits
    as NumPy through the CUDA kernels in float32, a log line saying so, the plan in the storage type."""
    from cuda_harness import CpuLauncher
    from model.memory import model_weight_bytes
    from model.ops.cuda_ops import CudaOps

    path, want = make_int4_model(tmp_path / "act", "gptq", 64, act_order=True)
    with caplog.at_level("INFO", logger="spool.model"), open_tensors(path) as tensors:
        for tensor, values in want.items():
            np.testing.assert_array_equal(tensors.read(tensor), values)
    assert "GPTQ int4 weights in act-order (groups of 64 inputs scattered by g_idx): dequantized" in caplog.text
    runners = [runner(path), runner(path, CudaOps(np, CpuLauncher(), "float32"))]
    assert runners[1].model.weight_bytes == model_weight_bytes(path, "float32")
    assert_steps_match(runners, 1e-5)


def test_a_scattered_g_idx_without_desc_act_is_refused_at_load(checkpoints, tmp_path):
    """desc_act false in the config, but a g_idx that scatters the groups."""
    from safetensors.numpy import load_file, save_file

    path = with_quantization(checkpoints["gptq-64"][0], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = np.ascontiguousarray(tensors[name][::-1])
    save_file(tensors, str(path / "model.safetensors"))
    with open_tensors(path) as tensors, pytest.raises(ModelError) as refused:
        tensors.read("model.layers.0.self_attn.q_proj.weight")
    assert "(act-order) but config.json's desc_act is not true" in str(refused.value)
    assert "\n" not in str(refused.value)


def llama_8b(projection_kind: str, float_kind: str) -> list[tuple[str, tuple]]:
    """Llama-3.1-8B's tensors (tools/make_model.py's list) as (kind, shape), no file: every layer's
    projections of projection_kind, the rest (embedding, LM head, norms) of float_kind."""
    tensors = make_model.tensors(make_model.SHAPES["llama3.1-8b"])
    return [(projection_kind if t.layer is not None and len(t.shape) == 2 else float_kind, t.shape) for t in tensors]


def test_an_8b_awq_plans_its_int4_blocks():
    """Llama-3.1-8B's shapes as an AWQ group-128 checkpoint holds them (projections int4, the rest
    float16), no file: 5.8 GB planned on the GPU, against 9.5 GB had the projections been Q8_0."""
    from model.memory import planned_weight_bytes

    planned = planned_weight_bytes(llama_8b("int4_128", "F16"), "bfloat16")
    assert 5.7e9 < planned < 5.9e9
    assert planned < planned_weight_bytes(llama_8b("q8_0", "F16"), "bfloat16") - 3.5e9