"""A broken model is one clear line that names the problem and the fix, never a traceback."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from model.errors import ModelError
from model.runner import ModelRunner
from model.weights import read_model_tensors
from test_loading import write_safetensors


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    return d


def load_error(path) -> str:
    with pytest.raises(ModelError) as e:
        ModelRunner.from_dir(path, num_blocks=4)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_directory(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    assert "no config.json" in load_error(tmp_path)


def test_malformed_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    assert "cannot read" in load_error(model_copy)
    (model_copy / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "malformed" in load_error(model_copy)


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_copy / "config.json").write_text(json.dumps(cfg))
    message = load_error(model_copy)
    assert "unsupported architecture 'gpt2'" in message and "llama" in message


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors(model_copy, keep):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    assert "corrupt or truncated" in load_error(model_copy)


def test_garbage_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "corrupt or truncated" in load_error(model_copy)


@pytest.mark.parametrize("method,shown", [
    ("awq", "AWQ"), ("gptq", "GPTQ"), ("fbgemm_fp8", "FP8"), ("bitsandbytes", "bitsandbytes"),
    ("compressed-tensors", "compressed-tensors"), (None, "quantized"),
])
def test_quantized_checkpoint_is_refused_by_name(model_copy, method, shown):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["quantization_config"] = {"bits": 8} | ({} if method is None else {"quant_method": method})
    (model_copy / "config.json").write_text(json.dumps(cfg))
    message = load_error(model_copy)
    assert f"holds {shown} weights" in message and "cannot load" in message and "GGUF" in message


@pytest.mark.parametrize("dtype,shown", [
    ("F8_E4M3", "FP8"), ("F8_E5M2", "FP8"), ("I8", "8-bit integer"), ("U8", "packed integer"),
    ("I32", "packed integer"),
])
def test_quantized_tensor_dtypes_are_refused_by_name(model_copy, dtype, shown):
    """A config.json without quantization_config over FP8 or packed-integer tensors."""
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = {n: ("F32", t) for n, t in read_model_tensors(model_copy).items()}
    rows, cols = tensors[name][1].shape
    tensors[name] = (dtype, np.zeros((rows, cols // 8), np.int32) if dtype == "I32" else
                     np.zeros((rows, cols), np.uint8))
    write_safetensors(model_copy / "model.safetensors", tensors)
    message = load_error(model_copy)
    assert f"holds {shown} weights" in message and dtype in message and name in message
    assert "corrupt" not in message


def test_missing_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert "model.layers.2." in load_error(model_copy)


def test_cli_prints_one_line_and_no_traceback(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--model", str(model_copy), "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model.safetensors" in lines[0]


def test_cli_generates_on_a_tiny_model(tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--model", str(tiny_dir),
                           "--max-tokens", "8", "--temperature", "0.8", "--seed", "3", "Hello"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    again = subprocess.run([sys.executable, "-m", "app", "generate", "--model", str(tiny_dir),
                            "--max-tokens", "8", "--temperature", "0.8", "--seed", "3", "Hello"],
                           capture_output=True, text=True, timeout=120)
    assert proc.stdout == again.stdout and proc.stdout.strip()


def test_cli_rejects_bad_sampling_flags(tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--model", str(tiny_dir),
                           "--top-p", "1.5", "Hello"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: top_p must be in (0, 1], got 1.5"


def cli_error(*argv) -> str:
    """The one line a refused command prints (exit 1 or 2), with no traceback."""
    proc = subprocess.run([sys.executable, "-m", "app", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_cli_refuses_a_backend_or_dtype_it_cannot_run(tiny_dir):
    from cuda_harness import gpu_available

    assert "--backend cuda" in cli_error("generate", "--model", str(tiny_dir), "--dtype", "float16", "hi")
    if gpu_available():
        pytest.skip("this machine has a GPU: --backend cuda would run")
    line = cli_error("generate", "--model", str(tiny_dir), "--backend", "cuda", "hi")
    assert "needs CuPy" in line or "no CUDA device" in line
    line = cli_error("serve", "--model", str(tiny_dir), "--backend", "cuda", "--port", free_port())
    assert "--backend cpu" in line


def test_cli_refuses_a_quantized_checkpoint_in_one_line(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 8}  # 4-bit AWQ loads (model/quant/awq_gptq.py)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    line = cli_error("serve", "--model", str(model_copy), "--port", free_port())
    assert "holds AWQ weights of 8 bits" in line and "cannot load" in line


# serve's CLI in a fresh process, numba's cache empty; prints whether the CPU kernels were imported
REFUSED_SERVE = """
import json, sys
from app.__main__ import main
code = main(["serve", "--model", sys.argv[1], "--backend", "cpu", "--port", sys.argv[2]])
print(json.dumps({"code": code, "kernels": "model.ops.numba_ops" in sys.modules}))
"""


@pytest.mark.parametrize("refusal", ["config", "tensors"])
def test_serve_refuses_an_fp8_checkpoint_before_compiling_kernels(model_copy, tmp_path, refusal):
    """On a cold cache the kernels take tens of seconds to compile: a refused model says so at once."""
    if refusal == "config":
        cfg = json.loads((model_copy / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2"}  # e4m3 loads (model/quant/fp8.py)
        (model_copy / "config.json").write_text(json.dumps(cfg))
    else:
        tensors = {n: ("F32", t) for n, t in read_model_tensors(model_copy).items()}
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = ("F8_E4M3", np.zeros(tensors[name][1].shape, np.uint8))
        write_safetensors(model_copy / "model.safetensors", tensors)
    proc = subprocess.run([sys.executable, "-c", REFUSED_SERVE, str(model_copy), free_port()], capture_output=True,
                          text=True, timeout=300, env=os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    assert json.loads(proc.stdout) == {"code": 1, "kernels": False}, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "holds FP8 weights" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("head_dim", [640, 68])  # past Gemma 4's full layers' 512; not in eights
def test_the_cuda_backend_refuses_a_model_its_kernels_cannot_run(tiny_dir, head_dim):
    from dataclasses import replace

    from model.backend import Backend, check_model
    from model.config import ModelConfig

    config = ModelConfig.load(tiny_dir)
    check_model(Backend("cuda", "bfloat16", None), config)  # the tiny model fits
    check_model(Backend("cuda", "bfloat16", None), replace(config, num_heads=32, num_kv_heads=1, head_dim=256))
    check_model(Backend("cuda", "bfloat16", None), replace(config, num_heads=8, num_kv_heads=1, head_dim=512))
    config = replace(config, head_dim=head_dim)
    with pytest.raises(ValueError, match=str(head_dim)) as e:
        check_model(Backend("cuda", "bfloat16", None), config)
    assert "--backend cpu" in str(e.value)
    check_model(Backend("numpy", "float32", None), config)  # NumPy runs anything
