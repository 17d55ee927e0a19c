"""Derive a Hugging Face model directory from a Llama-family GGUF file, whose weights stay in
the GGUF: Spool reads them from it in place (model/gguf/tensors.py), never writing them again.

`convert_gguf(path, out_dir)` reads the GGUF's metadata (metadata.py) and writes:

    config.json              the model's shape, as transformers would write it
    tokenizer.json           a `tokenizers` tokenizer rebuilt from the GGUF vocabulary
    tokenizer_config.json    special tokens, add_bos_token and the chat template
    generation_config.json   bos/eos ids
    model.gguf               a link to the GGUF (its absolute path), or the file itself, moved
                             in (move=True: the default model's file, extracted for it)

The output appears atomically: everything is written into a hidden temporary sibling of
`out_dir`, which is renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from model.errors import ModelError, one_line
from model.gguf.metadata import GGUFModel, read_gguf
from model.gguf.tokenizer import build_tokenizer, tokenizer_config
from model.weights import GGUF_NAME


def convert_gguf(gguf_path: Path, out_dir: Path, *, move: bool = False) -> Path:
    """Derive the Hugging Face directory of the GGUF at `gguf_path` at `out_dir`; return it.
    move: the GGUF itself goes into the directory (else a link to it does).

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
        for name, content in json_files.items():
            _write_json(tmp / name, content)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _fsync_path(tmp / "tokenizer.json")
        if move:
            os.replace(gguf_path, tmp / GGUF_NAME)
        else:
            os.symlink(gguf_path.resolve(), tmp / GGUF_NAME)
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
        "hidden_act": "gelu_pytorch_tanh" if c.gelu else "silu",
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
    if c.rope_layers is not None:
        config["no_rope_layers"] = [int(r) for r in c.rope_layers]
    if c.partial_rotary_factor != 1.0:
        config["partial_rotary_factor"] = c.partial_rotary_factor
    if c.layer_windows:
        config["sliding_window"] = max(c.layer_windows)
        config["layer_types"] = ["sliding_attention" if w else "full_attention" for w in c.layer_windows]
    config.update(c.family.hf_fields(c))
    if c.num_experts:
        config[c.family.experts_key] = c.num_experts
        config["num_experts_per_tok"] = c.experts_per_token
        config["moe_intermediate_size"] = c.expert_intermediate_size
        config["norm_topk_prob"] = c.norm_topk_prob
        if c.moe_layers is not None:
            config["mlp_only_layers"] = [i for i, sparse in enumerate(c.moe_layers) if not sparse]
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
