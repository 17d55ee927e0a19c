"""Convert a Llama-family GGUF file into a Hugging Face model directory.

`convert_gguf(path, out_dir)` reads the GGUF's metadata (metadata.py), dequantizes every tensor
to float32, undoes llama.cpp's q/k row permutation (architecture `llama` only), and writes:

    config.json              the model's shape, as transformers would write it
    model.safetensors        float16 weights under Hugging Face names (float32 for Q8_0 and
                             Q4_1 tensors, so that the CPU backend gets the file's own
                             blocks back exactly)
    tokenizer.json           a `tokenizers` tokenizer rebuilt from the GGUF vocabulary
    tokenizer_config.json    special tokens, add_bos_token and the chat template
    generation_config.json   bos/eos ids

The output appears atomically: everything is written into a hidden temporary sibling of
`out_dir`, which is renamed into place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from model.errors import ModelError, one_line
from model.gguf.metadata import GGUFModel, GGUFTensor, read_gguf
from model.gguf.tokenizer import build_tokenizer, tokenizer_config


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert the GGUF at `gguf_path` into a Hugging Face directory at `out_dir`; return it.

    `out_dir` must not exist yet. If another process creates it while this one converts (two
    first runs racing), the other's complete copy is kept and this one's is discarded.
    Raises ModelError, with a one-line message, for anything the user can fix.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ModelError(
            f"output directory {out_dir} already exists; remove it or convert into another directory"
        )
    model = read_gguf(gguf_path)  # everything is checked before any file is written
    tokenizer = build_tokenizer(model.vocab, gguf_path)
    json_files = {
        "config.json": _hf_config(model),
        "generation_config.json": _generation_config(model),
        "tokenizer_config.json": tokenizer_config(model.vocab, model.config.max_position_embeddings),
    }

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as exc:
        raise ModelError(
            f"cannot create a directory in {out_dir.parent} ({one_line(exc)}); choose a writable location"
        ) from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
        _write_weights(model.tensors, tmp / "model.safetensors", gguf_path, progress)
        for name, content in json_files.items():
            _write_json(tmp / name, content)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _fsync_path(tmp / "tokenizer.json")
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if (out_dir / "config.json").is_file():
                # Lost a race with another converter that finished first: use its copy.
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            raise
        _fsync_dir(out_dir.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise ModelError(
                f"could not write the converted model to {out_dir} ({one_line(exc)});"
                " check free disk space and permissions"
            ) from None
        raise
    return out_dir


def _hf_config(m: GGUFModel) -> dict[str, Any]:
    """config.json, as transformers would write it for this model."""
    c = m.config
    config = {
        "architectures": list(c.architectures),
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "bos_token_id": m.vocab.bos_id,
        "eos_token_id": m.vocab.eos_id,
        "torch_dtype": c.torch_dtype,
    }
    if c.model_type == "llama":
        config["mlp_bias"] = False
    if c.model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    return config


def _generation_config(m: GGUFModel) -> dict[str, Any]:
    eos_id = m.vocab.eos_id
    gen_eos = [eos_id] + [i for i in m.vocab.extra_eos_ids if i != eos_id]
    generation_config = {
        "bos_token_id": m.vocab.bos_id,
        "eos_token_id": gen_eos[0] if len(gen_eos) == 1 else gen_eos,
    }
    if m.vocab.pad_id is not None:
        generation_config["pad_token_id"] = m.vocab.pad_id
    return generation_config


def _dequantized(t, permute: int, shape: tuple[int, ...], path: Path) -> np.ndarray:
    import gguf

    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ModelError(
            f"tensor {t.name} in {path.name} uses the quantization {t.tensor_type.name}, which the gguf"
            " package cannot dequantize; use a GGUF with another quantization (Q8_0, Q4_K, F16...)"
        ) from None
    except Exception as exc:
        raise ModelError(f"tensor {t.name} in {path.name} is unreadable ({one_line(exc)}); re-download the file") from None
    w = np.asarray(w, dtype=np.float32).reshape(shape)
    if permute:
        # Undo llama.cpp's rope layout: rows go from (head, pair, 2) back to (head, 2, pair).
        w = w.reshape(permute, w.shape[0] // permute // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    out = w.astype(_stored_dtype(t))
    if not np.isfinite(out).all():
        raise ModelError(
            f"tensor {t.name} in {path.name} has values outside float16's range (or NaN);"
            " this converter writes float16 and cannot represent it"
        )
    return out


def _stored_dtype(t) -> np.dtype:
    """float16, except for Q8_0 and Q4_1 tensors: their values (a float16 scale times an int8;
    a float16 scale times 0..15 plus a float16 minimum) are exact in float32, so the CPU
    backend gets the file's blocks back bit for bit at load (model/quant/pack.py), where float16
    would round them."""
    import gguf

    exact = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1)
    return np.dtype(np.float32 if t.tensor_type in exact else np.float16)


def _write_weights(tensors: tuple[GGUFTensor, ...], dest: Path, gguf_path: Path, progress: bool) -> None:
    """Stream a safetensors file: header first, then one tensor at a time (memory: one tensor)."""
    from tqdm import tqdm

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in tensors:
        dtype = _stored_dtype(e.tensor)
        nbytes = dtype.itemsize * math.prod(e.shape)
        header[e.hf_name] = {"dtype": f"F{8 * dtype.itemsize}", "shape": list(e.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        bar = tqdm(tensors, desc=f"Converting {gguf_path.name}", unit="tensor",
                   disable=not progress, file=sys.stderr, leave=False)
        for e in bar:
            arr = _dequantized(e.tensor, e.permute_heads, e.shape, gguf_path)
            f.write(np.ascontiguousarray(arr, dtype=_stored_dtype(e.tensor).newbyteorder("<")).tobytes())
        bar.close()
        f.flush()
        os.fsync(f.fileno())


def _write_json(dest: Path, content: dict) -> None:
    with open(dest, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform; the rename itself is what matters
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
