"""A GGUF file's metadata, read once and checked into a typed value: the architecture, its
shapes and rope scaling, the tensors under their Hugging Face names, and the tokenizer's fields.

Supported: architectures llama (Mixtral too, with experts), qwen2 (q/k/v bias), qwen3 (q/k
norm), qwen3moe and olmoe (experts: each a slice of the file's 3-D tensors), smollm3 (every 4th
layer without rotation), phi3 (fused q/k/v and gate/up, LongRoPE factors as tensors, partial
rotation), gemma2 and gemma3 (norms around each block, stored as 1 + w; sliding windows in
llama.cpp's layer pattern; soft caps); tokenizers `gpt2` (byte-level BPE) and `llama`
(SentencePiece). What llama.cpp infers rather than stores is inferred the same way (Gemma's
query scale from the layer count, Gemma 3's sliding layers' theta, Phi-3's window ignored,
whether an architecture renormalises its top-k routing weights). Anything Spool cannot
represent faithfully (other architectures, shared experts, a sliding window elsewhere, unknown
rope scaling, unknown tensors) raises ModelError instead of being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ARCHITECTURES, ModelConfig
from model.errors import ModelError, one_line
from model.gguf.index import read_index
from model.gguf.gemma import gemma_switches
from model.gguf.rope import rope_scaling
from model.weights import expert_tensor_names

# general.architecture -> (HF model_type, HF architectures entry)
HF_NAMES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
MIXTRAL = ("mixtral", "MixtralForCausalLM")  # architecture llama with experts
GEMMA = ("gemma2", "gemma3")
# whether llama.cpp renormalises an architecture's top-k routing weights (build_moe_ffn's norm_w)
_NORMALISED_TOP_K = {"llama": True, "qwen3moe": True, "olmoe": False}
# a MoE layer's tensors: the router and the experts' 3-D stacks -> their part of an expert
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}

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
# where an architecture names a layer's tensors otherwise
_ARCH_LAYER_TENSORS = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
_REQUIRED_LAYER_TENSORS = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
)
_ARCH_REQUIRED = {
    "phi3": ("attn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_norm.weight", "ffn_up.weight",
             "ffn_down.weight"),
    "gemma2": _REQUIRED_LAYER_TENSORS + ("post_attention_norm.weight", "post_ffw_norm.weight"),
    "gemma3": _REQUIRED_LAYER_TENSORS + ("post_attention_norm.weight", "post_ffw_norm.weight",
                                         "attn_q_norm.weight", "attn_k_norm.weight"),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that carry no weights Hugging Face needs (rope_freqs is read into
# the rope scaling instead; attn_rot_embd is an old precomputed rotary table).
_CONSUMED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4


@dataclass(frozen=True)
class GGUFTensor:
    hf_name: str
    tensor: Any  # the gguf reader's tensor (name, tensor_type, data mapped from the file), or index.TensorInfo
    permute_heads: int  # llama.cpp's rope row order over this many heads, to undo; 0 for none
    shape: tuple[int, ...]  # Hugging Face's
    expert: int | None = None  # this expert's matrix of a 3-D stack of experts

    def byte_range(self) -> tuple[int, int]:
        """(offset, bytes) of this entry's data in the file (tensor: an index.TensorInfo)."""
        if self.expert is None:
            return self.tensor.data_offset, self.tensor.n_bytes
        size = self.tensor.n_bytes // int(self.tensor.shape[-1])
        return self.tensor.data_offset + self.expert * size, size


@dataclass(frozen=True)
class GGUFVocab:
    kind: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: tuple[str, ...]
    types: tuple[int, ...]  # one GGUF token type per token
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None  # for "llama", the first UNKNOWN token where the file names none
    pad_id: int | None
    extra_eos_ids: tuple[int, ...]  # end-of-turn and end-of-message tokens
    add_bos: bool
    add_eos: bool
    merges: tuple[tuple[str, str], ...]  # "gpt2" only
    pre: str  # "gpt2" only: tokenizer.ggml.pre
    scores: tuple[float, ...]  # "llama" only
    add_space_prefix: bool  # "llama" only
    chat_template: str | list[dict] | None  # as tokenizer_config.json holds it


@dataclass(frozen=True)
class GGUFModel:
    architecture: str  # general.architecture
    config: ModelConfig  # the shape: what ModelConfig.load reads back from the converted config.json
    tensors: tuple[GGUFTensor, ...]  # in the file's order, each checked against its shape
    vocab: GGUFVocab


def read_gguf(path: Path) -> GGUFModel:
    """The metadata of the GGUF at path, every part checked; ModelError, in one line, for
    anything the user can fix."""
    reader = _open_gguf(path)
    arch = _architecture(reader, path)
    k = lambda name: f"{arch}.{name}"  # noqa: E731

    experts = int(_field(reader, k("expert_count")) or 0)
    if experts and arch not in _NORMALISED_TOP_K:
        raise ModelError(f"{path.name} is a mixture of experts of architecture {arch}, which Spool does not run;"
                         f" it runs those of {', '.join(_NORMALISED_TOP_K)}")
    if any(t.name.endswith("_shexp.weight") for t in reader.tensors):
        raise ModelError(f"{path.name} has shared experts (Qwen2-MoE's, DeepSeek's), which Spool does not run")
    if _field(reader, k("attention.sliding_window")) and arch not in (*GEMMA, "phi3"):
        raise ModelError(
            f"{path.name} uses sliding-window attention, which this GGUF converter does not support"
            f" for architecture {arch}; use the Hugging Face model directory instead"
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
    if rope_dims != head_dim and (arch in ("llama", "smollm3") or rope_dims % 2 or rope_dims > head_dim):
        raise ModelError(
            f"{path.name} applies rope to {rope_dims} of {head_dim} head dimensions (partial rotary),"
            f" which Spool does not support for architecture {arch}"
        )
    # GGUF stores these as float32: keep their shortest decimal form (1e-05, not 9.99999974e-06).
    eps = float(str(np.float32(_field(reader, k("attention.layer_norm_rms_epsilon"), 1e-5))))
    theta = float(str(np.float32(_field(reader, k("rope.freq_base"), 10000.0))))
    ctx = int(_field(reader, k("context_length"), 2048))

    tensors = {t.name: t for t in reader.tensors}
    scaling = rope_scaling(lambda name: _field(reader, k(f"rope.{name}")), tensors, rope_dims, theta, path, ctx)
    entries = _entries(reader.tensors, arch, layers, heads, kv_heads, path, experts)
    have = {e.tensor.name for e in entries}
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in have for i in range(layers)) if experts else ()
    _check_complete(have, arch, layers, path, sparse)
    biases = {f"blk.{i}.attn_{x}.bias" for i in range(layers) for x in "qkv"}
    has_bias = any(n in have for n in biases)
    if has_bias and not biases <= have:
        raise ModelError(f"{path.name} has q/k/v biases on some layers only; the file is inconsistent")

    vocab = int(tensors["token_embd.weight"].shape[1])
    expert_ffn = int(_field(reader, k("expert_feed_forward_length"), ffn))
    whole_qk_norm = arch == "olmoe"
    shapes = _hf_shapes(vocab, hidden, ffn, heads, kv_heads, head_dim, whole_qk_norm)
    for e in entries:
        want = _expert_shape(e, experts, hidden, expert_ffn) or shapes.get(e.hf_name) or \
            shapes[e.hf_name.split(".", 3)[3]]
        if e.shape != want:
            raise ModelError(
                f"tensor {e.tensor.name} in {path.name} has shape {e.shape}, but the metadata implies {want};"
                " the file is inconsistent"
            )
    v = _read_vocab(reader, path)
    model_type, hf_arch = MIXTRAL if experts and arch == "llama" else HF_NAMES[arch]
    moe = {}
    if experts:
        moe = dict(num_experts=experts, experts_per_token=int(_require(reader, k("expert_used_count"), path)),
                   expert_intermediate_size=expert_ffn, moe_layers=None if all(sparse) else sparse,
                   norm_topk_prob=bool(_field(reader, k("expert_weights_norm"), _NORMALISED_TOP_K[arch])))
    config = ModelConfig(
        model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=ctx, tie_word_embeddings="output.weight" not in tensors,
        attention_bias=has_bias, qk_norm=ARCHITECTURES[model_type][1],
        eos_token_ids=() if v.eos_id is None else (v.eos_id,), bos_token_id=v.bos_id, torch_dtype="float16",
        architectures=(hf_arch,), partial_rotary_factor=rope_dims / head_dim,
        # SmolLM3: every 4th layer without rotation, as llama.cpp fixes it (n_no_rope_layer_step)
        rope_layers=tuple((i + 1) % 4 != 0 for i in range(layers)) if arch == "smollm3" else None,
        **(gemma_switches(lambda key, default=None: _field(reader, key, default), arch, layers, hidden, heads,
                          head_dim) if arch in GEMMA else {}),
        qk_norm_whole=whole_qk_norm, **moe,
    )
    return GGUFModel(architecture=arch, config=config, tensors=tuple(entries), vocab=v)


def read_gguf_tensors(path: Path) -> tuple[GGUFTensor, ...]:
    """The tensors alone, as read_gguf's (loading checks their shapes against config.json),
    each GGUFTensor.tensor an index.TensorInfo: what serving the file in place needs, read from
    its header without its vocabulary (index.py)."""
    fields, infos = read_index(path)
    arch = _supported(fields.get("general.architecture"), path)
    need = {name: fields.get(f"{arch}.{name}") for name in ("block_count", "attention.head_count")}
    missing = [name for name, value in need.items() if value is None]
    if missing:
        raise ModelError(f"{path} lacks the GGUF metadata key {arch}.{missing[0]}; it is not a complete Llama-family GGUF")
    heads = int(need["attention.head_count"])
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    return tuple(_entries(infos, arch, int(need["block_count"]), heads, kv_heads, path, experts))


def _architecture(reader, path: Path) -> str:
    return _supported(_field(reader, "general.architecture"), path)


def _supported(arch, path: Path) -> str:
    if arch not in HF_NAMES:
        raise ModelError(
            f"GGUF architecture {arch!r} in {path.name} is not supported"
            f" (supported: {', '.join(HF_NAMES)}); use a Hugging Face model directory instead"
        )
    return arch


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


def _entries(tensors, arch: str, layers: int, heads: int, kv_heads: int, path: Path,
             experts: int = 0) -> list[GGUFTensor]:
    """Every tensor (gguf's ReaderTensor or index.TensorInfo) under its Hugging Face name (an
    expert stack as one entry per expert, under the checkpoint's names for it); an unknown one
    means a model Spool would get wrong."""
    model_type = (MIXTRAL if experts and arch == "llama" else HF_NAMES[arch])[0]
    entries = []
    for t in tensors:
        name = t.name
        if name in _CONSUMED or name.endswith(".attn_rot_embd"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if name in _GLOBAL_TENSORS:
            entries.append(GGUFTensor(_GLOBAL_TENSORS[name], t, 0, shape))
            continue
        parts = name.split(".", 2)
        names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get("gemma" if arch in GEMMA else arch, {})}
        known = parts[2] in names or (experts and parts[2] in ("ffn_gate_inp.weight", *_EXPERT_TENSORS))
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and known:
            i = int(parts[1])
            if i >= layers:
                raise ModelError(f"{path.name} has tensor {name} beyond its {layers} layers; the file is inconsistent")
            if experts and parts[2] in ("ffn_gate_inp.weight", *_EXPERT_TENSORS):
                entries += _expert_entries(t, i, parts[2], model_type, experts, path)
                continue
            permute = 0
            if arch in ("llama", "smollm3") and parts[2].startswith(("attn_q.", "attn_k.")):
                permute = heads if parts[2].startswith("attn_q.") else kv_heads
            entries.append(GGUFTensor(f"model.layers.{i}.{names[parts[2]]}", t, permute, shape))
            continue
        raise ModelError(
            f"{path.name} has tensor {name!r}, which this converter does not know how to map;"
            " use the Hugging Face model directory instead"
        )
    return entries


def _expert_entries(t, layer: int, suffix: str, model_type: str, experts: int, path: Path) -> list[GGUFTensor]:
    """The router, or one entry per expert of a 3-D stack (experts outermost: each a contiguous
    slice of the tensor's bytes, GGUFTensor.expert)."""
    prefix, names = expert_tensor_names(model_type, layer)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if suffix == "ffn_gate_inp.weight":
        return [GGUFTensor(prefix + "gate.weight", t, 0, shape)]
    if len(shape) != 3 or shape[0] != experts:
        raise ModelError(f"tensor {t.name} in {path.name} has shape {shape}, not {experts} experts' matrices;"
                         " the file is inconsistent")
    name = names[_EXPERT_TENSORS[suffix]]
    return [GGUFTensor(f"{prefix}experts.{e}.{name}.weight", t, 0, shape[1:], expert=e) for e in range(experts)]


def _expert_shape(e: GGUFTensor, experts: int, hidden: int, ffn: int) -> tuple | None:
    """What an expert's tensor or a router should be; None for every other tensor."""
    if e.expert is not None:
        return (hidden, ffn) if e.tensor.name.endswith("ffn_down_exps.weight") else (ffn, hidden)
    return (experts, hidden) if e.tensor.name.endswith("ffn_gate_inp.weight") else None


def _check_complete(have: set[str], arch: str, layers: int, path: Path, sparse: tuple = ()) -> None:
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in have]
    required = _ARCH_REQUIRED.get(arch, _REQUIRED_LAYER_TENSORS)
    moe = ("ffn_gate_inp.weight", *_EXPERT_TENSORS)
    for i in range(layers):
        wanted = [s for s in required if not (sparse and sparse[i] and s.startswith(("ffn_gate.", "ffn_up.", "ffn_down.")))]
        missing += [f"blk.{i}.{s}" for s in wanted + (list(moe) if sparse and sparse[i] else [])
                    if f"blk.{i}.{s}" not in have]
    if arch == "qwen2":
        missing += [f"blk.{i}.attn_{x}.bias" for i in range(layers) for x in "qkv" if f"blk.{i}.attn_{x}.bias" not in have]
    if arch in ("qwen3", "qwen3moe", "olmoe"):
        missing += [f"blk.{i}.attn_{x}_norm.weight" for i in range(layers) for x in "qk"
                    if f"blk.{i}.attn_{x}_norm.weight" not in have]
    if missing:
        raise ModelError(
            f"{path.name} lacks tensor {missing[0]} ({len(missing)} missing in all); the file is incomplete"
        )


def _hf_shapes(vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
               whole_qk_norm: bool = False) -> dict:
    """Hugging Face's shapes: by full name for the global tensors, by per-layer name otherwise
    (OLMoE's q/k norms over the whole projection)."""
    return {
        "model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.q_proj.bias": (heads * head_dim,), "self_attn.k_proj.bias": (kv_heads * head_dim,),
        "self_attn.v_proj.bias": (kv_heads * head_dim,),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (heads * head_dim,) if whole_qk_norm else (head_dim,),
        "self_attn.k_norm.weight": (kv_heads * head_dim,) if whole_qk_norm else (head_dim,),
        "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
        "mlp.gate_up_proj.weight": (2 * ffn, hidden),
        "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
    }


def _read_vocab(reader, path: Path) -> GGUFVocab:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ModelError(f"{path.name} has no tokenizer (tokenizer.ggml.model); use a GGUF that embeds one")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{path.name} has no token list (tokenizer.ggml.tokens); use a GGUF that embeds one")
    n = len(tokens)
    types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * n
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

    merges, pre, scores, prefix = [], "", [], True
    if kind == "gpt2":
        merges_raw = _field(reader, "tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelError(f"{path.name} has a BPE tokenizer without merges; the file is incomplete")
        for m in merges_raw:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ModelError(f"{path.name} has a malformed BPE merge {m!r}; the file is inconsistent")
            merges.append((left, right))
        pre = _field(reader, "tokenizer.ggml.pre", "default")
    elif kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores")
        if not scores or len(scores) != n:
            raise ModelError(f"{path.name} has a SentencePiece tokenizer without one score per token; the file is inconsistent")
        if unk_id is None:
            unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    else:
        raise ModelError(
            f"{path.name} uses the tokenizer type {kind!r}, which this converter does not support"
            " (supported: gpt2, llama); use the Hugging Face model directory instead"
        )

    template = _field(reader, "tokenizer.chat_template")
    named = _field(reader, "tokenizer.chat_templates") or []
    if named:
        chat_template = [{"name": "default", "template": template}] if template else []
        for name in named:
            t = _field(reader, f"tokenizer.chat_template.{name}")
            if t:
                chat_template.append({"name": name, "template": t})
    else:
        chat_template = template or None
    return GGUFVocab(
        kind=kind, tokens=tuple(tokens), types=tuple(types), bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
        pad_id=pad_id, extra_eos_ids=tuple(extra_eos), add_bos=add_bos, add_eos=add_eos, merges=tuple(merges),
        pre=pre, scores=tuple(scores), add_space_prefix=prefix, chat_template=chat_template,
    )
