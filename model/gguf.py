"""Convert a Llama-family GGUF file into a Hugging Face model directory.

`convert_gguf(path, out_dir)` reads the GGUF with the `gguf` package, dequantizes every tensor
to float32, undoes llama.cpp's q/k row permutation (architecture `llama` only), and writes:

    config.json              the model's shape, as transformers would write it
    model.safetensors        float16 weights under Hugging Face names (float32 for Q8_0 and
                             Q4_1 tensors, so that the CPU backend gets the file's own
                             blocks back exactly)
    tokenizer.json           a `tokenizers` tokenizer rebuilt from the GGUF vocabulary
    tokenizer_config.json    special tokens, add_bos_token and the chat template
    generation_config.json   bos/eos ids

Supported: architectures llama, qwen2 (q/k/v bias) and qwen3 (q/k norm); tokenizers `gpt2`
(byte-level BPE) and `llama` (SentencePiece, rebuilt as a byte-fallback BPE). Anything the
converter cannot represent faithfully (other architectures, MoE, sliding windows, unknown rope
scaling, unknown tensors) raises ModelError instead of being dropped.

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

# general.architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# GGUF per-layer tensor suffix -> Hugging Face per-layer name
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED_LAYER_TENSORS = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that carry no weights Hugging Face needs (rope_freqs is read into
# config.json's rope_scaling instead; attn_rot_embd is an old precomputed rotary table).
_CONSUMED = {"rope_freqs.weight"}

# GGUF token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, as the models' own tokenizer.json files state them (llama.cpp runs
# equivalent hand-expanded forms, selected by tokenizer.ggml.pre).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer family
_PRE_FAMILIES = {
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2",
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "jais": "gpt2",
}


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
    reader = _open_gguf(gguf_path)
    plan = _plan(reader, gguf_path)  # validates everything before any file is written

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as exc:
        raise ModelError(
            f"cannot create a directory in {out_dir.parent} ({one_line(exc)}); choose a writable location"
        ) from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
        _write_weights(plan, tmp / "model.safetensors", gguf_path, progress)
        for name, content in plan["json_files"].items():
            _write_json(tmp / name, content)
        plan["tokenizer"].save(str(tmp / "tokenizer.json"))
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


# ---------------------------------------------------------------------------------------------
# Reading and validating
# ---------------------------------------------------------------------------------------------


def _open_gguf(path: Path):
    import gguf

    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist; pass --model with an existing .gguf file")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError, IndexError, KeyError... on bad files
        raise ModelError(
            f"{path} is not a readable GGUF file ({one_line(exc)});"
            " it may be truncated or not a GGUF: re-download it"
        ) from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as exc:
        raise ModelError(f"GGUF metadata {key} is unreadable ({one_line(exc)}); re-download the file") from None


def _require(reader, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelError(f"{path} lacks the GGUF metadata key {key}; it is not a complete Llama-family GGUF")
    return value


def _plan(reader, path: Path) -> dict:
    """Everything to write, checked up front: config, tokenizer, and the tensor list."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"GGUF architecture {arch!r} in {path.name} is not supported"
            f" (supported: {', '.join(ARCHITECTURES)}); use a Hugging Face model directory instead"
        )
    model_type, hf_arch = ARCHITECTURES[arch]
    k = lambda name: f"{arch}.{name}"  # noqa: E731

    if (_field(reader, k("expert_count")) or 0) > 0:
        raise ModelError(f"{path.name} is a mixture-of-experts model, which Spool does not run; use a dense model")
    if _field(reader, k("attention.sliding_window")):
        raise ModelError(
            f"{path.name} uses sliding-window attention, which this GGUF converter does not support;"
            " use the Hugging Face model directory instead"
        )

    hidden = int(_require(reader, k("embedding_length"), path))
    layers = int(_require(reader, k("block_count"), path))
    ffn = int(_require(reader, k("feed_forward_length"), path))
    heads = int(_require(reader, k("attention.head_count"), path))
    kv_heads = int(_field(reader, k("attention.head_count_kv"), heads))
    head_dim = int(_field(reader, k("attention.key_length"), hidden // heads))
    value_dim = int(_field(reader, k("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise ModelError(
            f"{path.name} has key length {head_dim} but value length {value_dim}, which Spool does not support"
        )
    rope_dims = int(_field(reader, k("rope.dimension_count"), head_dim))
    if rope_dims != head_dim:
        raise ModelError(
            f"{path.name} applies rope to {rope_dims} of {head_dim} head dimensions (partial rotary),"
            " which Spool does not support"
        )
    # GGUF stores these as float32: keep their shortest decimal form (1e-05, not 9.99999974e-06).
    eps = float(str(np.float32(_field(reader, k("attention.layer_norm_rms_epsilon"), 1e-5))))
    theta = float(str(np.float32(_field(reader, k("rope.freq_base"), 10000.0))))
    ctx = int(_field(reader, k("context_length"), 2048))

    tensors = {t.name: t for t in reader.tensors}
    rope_scaling = _rope_scaling(reader, arch, tensors, head_dim, theta, ctx, path)

    # Map every tensor; an unknown one means a model this converter would get wrong.
    entries = []  # (hf_name, reader tensor, permute_heads or 0)
    for t in reader.tensors:
        name = t.name
        if name in _CONSUMED or name.endswith(".attn_rot_embd"):
            continue
        if name in _GLOBAL_TENSORS:
            entries.append((_GLOBAL_TENSORS[name], t, 0))
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            i = int(parts[1])
            if i >= layers:
                raise ModelError(f"{path.name} has tensor {name} beyond its {layers} layers; the file is inconsistent")
            permute = 0
            if arch == "llama" and parts[2].startswith(("attn_q.", "attn_k.")):
                permute = heads if parts[2].startswith("attn_q.") else kv_heads
            entries.append((f"model.layers.{i}.{_LAYER_TENSORS[parts[2]]}", t, permute))
            continue
        raise ModelError(
            f"{path.name} has tensor {name!r}, which this converter does not know how to map;"
            " use the Hugging Face model directory instead"
        )
    have = {t.name for _, t, _ in entries}
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in have]
    missing += [f"blk.{i}.{s}" for i in range(layers) for s in _REQUIRED_LAYER_TENSORS if f"blk.{i}.{s}" not in have]
    if arch == "qwen2":
        missing += [f"blk.{i}.attn_{x}.bias" for i in range(layers) for x in "qkv" if f"blk.{i}.attn_{x}.bias" not in have]
    if arch == "qwen3":
        missing += [f"blk.{i}.attn_{x}_norm.weight" for i in range(layers) for x in "qk"
                    if f"blk.{i}.attn_{x}_norm.weight" not in have]
    if missing:
        raise ModelError(
            f"{path.name} lacks tensor {missing[0]} ({len(missing)} missing in all); the file is incomplete"
        )
    biases = {f"blk.{i}.attn_{x}.bias" for i in range(layers) for x in "qkv"}
    has_bias = any(n in have for n in biases)
    if has_bias and not biases <= have:
        raise ModelError(f"{path.name} has q/k/v biases on some layers only; the file is inconsistent")

    # Expected Hugging Face shapes, checked against the GGUF's own.
    vocab = int(tensors["token_embd.weight"].shape[1])
    expected = {
        "model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    per_layer = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.q_proj.bias": (heads * head_dim,), "self_attn.k_proj.bias": (kv_heads * head_dim,),
        "self_attn.v_proj.bias": (kv_heads * head_dim,),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    planned = []
    for hf_name, t, permute in entries:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = expected.get(hf_name) or per_layer[hf_name.split(".", 3)[3]]
        if shape != want:
            raise ModelError(
                f"tensor {t.name} in {path.name} has shape {shape}, but the metadata implies {want};"
                " the file is inconsistent"
            )
        planned.append((hf_name, t, permute, shape))

    tie = "output.weight" not in tensors
    tokenizer, tok_info = _build_tokenizer(reader, path)
    bos_id, eos_id = tok_info["bos_token_id"], tok_info["eos_token_id"]

    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "attention_bias": has_bias,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float16",
    }
    if model_type == "llama":
        config["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    gen_eos = [eos_id] + [i for i in tok_info["extra_eos_ids"] if i != eos_id]
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": gen_eos[0] if len(gen_eos) == 1 else gen_eos,
    }
    if tok_info["pad_token_id"] is not None:
        generation_config["pad_token_id"] = tok_info["pad_token_id"]
    tok_config = dict(tok_info["tokenizer_config"])
    tok_config["model_max_length"] = ctx
    return {
        "tensors": planned,
        "tokenizer": tokenizer,
        "json_files": {
            "config.json": config,
            "generation_config.json": generation_config,
            "tokenizer_config.json": tok_config,
        },
    }


def _rope_scaling(reader, arch, tensors, head_dim, theta, ctx, path) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    scaling = None
    if kind is None:
        # Older GGUFs wrote only a factor, or the even older rope.scale_linear key.
        legacy = _field(reader, f"{arch}.rope.scale_linear")
        if factor not in (None, 0.0, 1.0):
            kind = "linear"
        elif legacy not in (None, 0.0, 1.0):
            kind, factor = "linear", legacy
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        for key, hf in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                        ("yarn_beta_slow", "beta_slow")):
            v = _field(reader, f"{arch}.rope.scaling.{key}")
            if v:
                scaling[hf] = float(v)
    elif kind not in (None, "none"):
        raise ModelError(
            f"{path.name} uses rope scaling {kind!r}, which this GGUF converter does not support;"
            " use the Hugging Face model directory instead"
        )
    if any(n in tensors for n in ("rope_factors_long.weight", "rope_factors_short.weight")):
        raise ModelError(
            f"{path.name} uses LongRoPE factors, which this GGUF converter does not support;"
            " use the Hugging Face model directory instead"
        )
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ModelError(f"{path.name} has both rope scaling {kind!r} and a rope_freqs tensor; the file is inconsistent")
        import gguf

        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()
        scaling = _match_llama3_rope(freqs, head_dim, theta)
        if scaling is None:
            raise ModelError(
                f"{path.name} has a rope_freqs tensor that matches no Llama 3 rope scaling this"
                " converter knows; use the Hugging Face model directory instead"
            )
    return scaling


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's rope scaling: what llama.cpp stores as rope_freqs."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _match_llama3_rope(freqs: np.ndarray, head_dim: int, theta: float) -> dict | None:
    if freqs.shape != (head_dim // 2,):
        return None
    # The parameters every published Llama 3.x checkpoint uses; the factor varies.
    factor = float(freqs.max())
    for orig in (8192, 4096, 16384, 2048):
        for low, high in ((1.0, 4.0),):
            want = llama3_rope_factors(head_dim, theta, factor, low, high, orig)
            if np.allclose(want, freqs, rtol=1e-3, atol=1e-4):
                return {
                    "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig,
                }
    return None


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _build_tokenizer(reader, path: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ModelError(f"{path.name} has no tokenizer (tokenizer.ggml.model); use a GGUF that embeds one")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{path.name} has no token list (tokenizer.ggml.tokens); use a GGUF that embeds one")
    n = len(tokens)
    types = _field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * n
    if len(types) != n:
        raise ModelError(f"{path.name} has {n} tokens but {len(types)} token types; the file is inconsistent")

    def tok_id(key):
        v = _field(reader, key)
        if v is None:
            return None
        v = int(v)
        if not 0 <= v < n:
            raise ModelError(f"{path.name}: {key} = {v} is outside the vocabulary of {n}; the file is inconsistent")
        return v

    bos_id = tok_id("tokenizer.ggml.bos_token_id")
    eos_id = tok_id("tokenizer.ggml.eos_token_id")
    unk_id = tok_id("tokenizer.ggml.unknown_token_id")
    pad_id = tok_id("tokenizer.ggml.padding_token_id")
    extra_eos = [i for i in (tok_id("tokenizer.ggml.eot_token_id"), tok_id("tokenizer.ggml.eom_token_id")) if i is not None]
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    if kind == "gpt2":
        merges_raw = _field(reader, "tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelError(f"{path.name} has a BPE tokenizer without merges; the file is incomplete")
        merges = []
        for m in merges_raw:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ModelError(f"{path.name} has a malformed BPE merge {m!r}; the file is inconsistent")
            merges.append((left, right))
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        family = _PRE_FAMILIES.get(pre)
        if family is None:
            raise ModelError(
                f"{path.name} uses the BPE pre-tokenizer {pre!r}, which this converter does not know;"
                " use the Hugging Face model directory instead"
            )
        try:
            model = models.BPE(vocab=vocab, merges=merges, byte_fallback=False,
                               ignore_merges=(family == "llama3"))
        except Exception as exc:
            raise ModelError(f"{path.name} has an invalid BPE vocabulary ({one_line(exc)}); the file is inconsistent") from None
        tok = Tokenizer(model)
        if family == "digits":
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif family in ("llama3", "qwen2"):
            pattern = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            if family == "qwen2":
                tok.normalizer = normalizers.NFC()
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        default_post = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores")
        if not scores or len(scores) != n:
            raise ModelError(f"{path.name} has a SentencePiece tokenizer without one score per token; the file is inconsistent")
        if unk_id is None:
            unk_id = next((i for i, ty in enumerate(types) if ty == _UNKNOWN), None)
        merges = _spm_merges(tokens, scores, types, vocab)
        try:
            model = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                               fuse_unk=True, byte_fallback=True)
        except Exception as exc:
            raise ModelError(f"{path.name} has an invalid SentencePiece vocabulary ({one_line(exc)}); the file is inconsistent") from None
        tok = Tokenizer(model)
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        steps = [normalizers.Prepend("▁")] if prefix else []
        tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
        default_post = None
    else:
        raise ModelError(
            f"{path.name} uses the tokenizer type {kind!r}, which this converter does not support"
            " (supported: gpt2, llama); use the Hugging Face model directory instead"
        )

    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, ty in enumerate(types) if ty in (_CONTROL, _UNKNOWN) and tokens[i]]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types) if ty == _USER_DEFINED and tokens[i]]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)

    if (add_bos and bos_id is not None) or (add_eos and eos_id is not None):
        single, pair, special = "$A:0", "$B:1", []
        if add_bos and bos_id is not None:
            single, pair = f"{tokens[bos_id]}:0 {single}", f"{tokens[bos_id]}:1 {pair}"
            special.append((tokens[bos_id], bos_id))
        if add_eos and eos_id is not None:
            single, pair = f"{single} {tokens[eos_id]}:0", f"{pair} {tokens[eos_id]}:1"
            if eos_id != bos_id:
                special.append((tokens[eos_id], eos_id))
        tok.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} {pair}", special_tokens=special)
    elif default_post is not None:
        tok.post_processor = default_post

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for key, i in (("bos_token", bos_id), ("eos_token", eos_id), ("unk_token", unk_id), ("pad_token", pad_id)):
        if i is not None:
            tokenizer_config[key] = tokens[i]
    template = _field(reader, "tokenizer.chat_template")
    named = _field(reader, "tokenizer.chat_templates") or []
    if named:
        entries = [{"name": "default", "template": template}] if template else []
        for name in named:
            t = _field(reader, f"tokenizer.chat_template.{name}")
            if t:
                entries.append({"name": name, "template": t})
        tokenizer_config["chat_template"] = entries
    elif template:
        tokenizer_config["chat_template"] = template

    return tok, {
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "extra_eos_ids": extra_eos, "tokenizer_config": tokenizer_config,
    }


def _spm_merges(tokens, scores, types, vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    Every normal token that splits into two vocabulary pieces yields a merge; a merge ranks by
    the merged token's score (higher first), then by the pieces' ids, as SentencePiece prefers
    the highest-scoring merged piece at each step.
    """
    ranked = []
    for i, (piece, score, ty) in enumerate(zip(tokens, scores, types)):
        if ty not in (_NORMAL, _USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(score), li, ri, left, right))
    ranked.sort(key=lambda r: r[:3])
    return [(r[3], r[4]) for r in ranked]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


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
    backend gets the file's blocks back bit for bit at load (model/ops/q8.py), where float16
    would round them."""
    import gguf

    exact = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1)
    return np.dtype(np.float32 if t.tensor_type in exact else np.float16)


def _write_weights(plan: dict, dest: Path, gguf_path: Path, progress: bool) -> None:
    """Stream a safetensors file: header first, then one tensor at a time (memory: one tensor)."""
    from tqdm import tqdm

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for hf_name, t, _, shape in plan["tensors"]:
        dtype = _stored_dtype(t)
        nbytes = dtype.itemsize * math.prod(shape)
        header[hf_name] = {"dtype": f"F{8 * dtype.itemsize}", "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        bar = tqdm(plan["tensors"], desc=f"Converting {gguf_path.name}", unit="tensor",
                   disable=not progress, file=sys.stderr, leave=False)
        for hf_name, t, permute, shape in bar:
            arr = _dequantized(t, permute, shape, gguf_path)
            f.write(np.ascontiguousarray(arr, dtype=_stored_dtype(t).newbyteorder("<")).tobytes())
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
