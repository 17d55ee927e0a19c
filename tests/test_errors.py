"""A broken model is one clear line that names the problem and the fix, never a traceback."""

import json
import shutil
import subprocess
import sys

import pytest

from model.errors import ModelError
from model.runner import ModelRunner


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
