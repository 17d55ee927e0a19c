"""A GGUF file's metadata, read once and checked into a typed value: the architecture's family
(model/families/), its shapes and rope scaling, the tensors under their Hugging Face names
(names.py), and the tokenizer's fields (vocab.py).

What llama.cpp infers rather than stores is inferred the same way, by the family
(Family.gguf_switches: a query scale from the layer count, a sliding layers' theta, a window
ignored; Family.gguf_top_k_normalised). Anything Spool cannot represent faithfully (other
architectures, shared experts, a sliding window its family does not read, unknown rope
scaling, unknown tensors) raises ModelError instead of being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig
from model.errors import ModelError, one_line
from model.families import Family, gguf_family
from model.gguf.names import EXPERT_TENSORS, FUSED_EXPERTS, ROUTER, GGUFTensor, entries, required_layer_tensors
from model.gguf.rope import rope_scaling
from model.gguf.vocab import GGUFVocab, read_vocab


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
    arch = _field(reader, "general.architecture")
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    field = lambda key, default=None: _field(reader, key, default)  # noqa: E731

    experts = int(_field(reader, k("expert_count")) or 0)
    family = gguf_family(arch, bool(experts), path)
    shared_names = {g for g, h in (family.gguf_names or {}).items() if "shared_expert" in h}
    if any(t.name.endswith("_shexp.weight") and t.name.split(".", 2)[-1] not in shared_names for t in reader.tensors):
        raise ModelError(f"{path.name} has shared experts (Qwen2-MoE's, DeepSeek's), which Spool does not run"
                         f" for architecture {arch}")
    if _field(reader, k("attention.sliding_window")) and not family.gguf_sliding_window:
        raise ModelError(
            f"{path.name} uses sliding-window attention, which this GGUF converter does not support"
            f" for architecture {arch}; use the Hugging Face model directory instead"
        )

    hidden = int(_require(reader, k("embedding_length"), path))
    mtp = int(_field(reader, k("nextn_predict_layers"), 0) or 0)  # multi-token-prediction blocks, last
    layers = int(_require(reader, k("block_count"), path)) - mtp
    # a model whose every layer routes (Qwen3.5-MoE) may have no dense width: its shared expert's
    ffn = int(_first(_field(reader, k("feed_forward_length")) or _field(reader, k("expert_shared_feed_forward_length"))
                     or _require(reader, k("feed_forward_length"), path)))
    heads = int(_require(reader, k("attention.head_count"), path))
    # one a layer where layers differ (Gemma 4's): the family's gguf_switches read them whole
    kv_heads = int(_first(_field(reader, k("attention.head_count_kv"), heads)))
    head_dim = int(_field(reader, k("attention.key_length"), hidden // heads))
    value_dim = int(_field(reader, k("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise ModelError(
            f"{path.name} has key length {head_dim} but value length {value_dim}, which Spool does not support"
        )
    rope_dims = int(_field(reader, k("rope.dimension_count"), head_dim))
    if rope_dims != head_dim and (family.gguf_rope_order or rope_dims % 2 or rope_dims > head_dim):
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
    partial = scaling.pop("partial_rotary_factor", None) if scaling else None
    if scaling and scaling["rope_type"] == "yarn" and not family.gguf_yarn_truncate:
        scaling["truncate"] = False
    switches = family.gguf_switches(field, layers, hidden, heads, head_dim)
    found = entries(reader.tensors, family, layers, heads, kv_heads, path, experts, mtp)
    have = {e.tensor.name for e in found}
    sparse = tuple(f"blk.{i}.{ROUTER}" in have for i in range(layers)) if experts else ()
    _check_complete(have, family, layers, path, sparse, switches.get("linear_layers"), switches.get("kv_sources"))
    biases = {f"blk.{i}.attn_{x}.bias" for i in range(layers) for x in "qkv"}
    has_bias = any(n in have for n in biases)
    if has_bias and not biases <= have:
        raise ModelError(f"{path.name} has q/k/v biases on some layers only; the file is inconsistent")

    vocab = int(tensors["token_embd.weight"].shape[1])
    expert_ffn = int(_field(reader, k("expert_feed_forward_length"), ffn))
    shapes = _hf_shapes(vocab, hidden, ffn, heads, kv_heads, head_dim, family.qk_norm_whole)
    if switches.get("attention_gate"):  # each head's query rows, then its gate's
        shapes["self_attn.q_proj.weight"] = (2 * heads * head_dim, hidden)
    if switches.get("delta_net"):
        shapes.update(_delta_net_shapes(switches["delta_net"], hidden))
    if switches.get("shared_expert_size"):
        size = switches["shared_expert_size"]
        shapes.update({"mlp.shared_expert.gate_proj.weight": (size, hidden), "mlp.shared_expert.up_proj.weight":
                       (size, hidden), "mlp.shared_expert.down_proj.weight": (hidden, size),
                       "mlp.shared_expert_gate.weight": (hidden,)})
    if mtp:  # the MTP layer's own (names.NEXTN)
        shapes.update({"mtp.fc.weight": (hidden, 2 * hidden), **{n: (hidden,) for n in (
            "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")}})
    shapes.update(family.gguf_shapes(switches, hidden, layers, vocab, experts))
    heads_of, widths = switches.get("layer_heads"), switches.get("layer_widths")

    def layer_shape(e: GGUFTensor) -> tuple:
        """Its shape in its layer, by that layer's K/V heads, head size and MLP width where they differ."""
        _, _, i, suffix = e.hf_name.split(".", 3)
        if heads_of or widths:
            kv, dim = heads_of[int(i)] if heads_of else (kv_heads, head_dim)
            own = _hf_shapes(vocab, hidden, widths[int(i)] if widths else ffn, heads, kv, dim, family.qk_norm_whole)
            return own.get(suffix) or shapes[suffix]
        return shapes[suffix]

    for e in found:
        want = _expert_shape(e, experts, hidden, expert_ffn) or shapes.get(e.hf_name) or layer_shape(e)
        if e.shape != want:
            raise ModelError(
                f"tensor {e.tensor.name} in {path.name} has shape {e.shape}, but the metadata implies {want};"
                " the file is inconsistent"
            )
    v = read_vocab(field, path)
    moe = {}
    if experts:
        moe = dict(num_experts=experts, experts_per_token=int(_require(reader, k("expert_used_count"), path)),
                   expert_intermediate_size=expert_ffn, moe_layers=None if all(sparse) else sparse,
                   norm_topk_prob=bool(_field(reader, k("expert_weights_norm"), family.gguf_top_k_normalised)))
    config = ModelConfig(**{**dict(
        model_type=family.model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=ctx, tie_word_embeddings="output.weight" not in tensors,
        attention_bias=has_bias, qk_norm=family.qk_norm,
        eos_token_ids=() if v.eos_id is None else (v.eos_id,), bos_token_id=v.bos_id, torch_dtype="float16",
        architectures=(family.architecture,), partial_rotary_factor=partial or rope_dims / head_dim,
        qk_norm_whole=family.qk_norm_whole), **moe, **switches})  # the family's own over the rest
    return GGUFModel(architecture=arch, config=config, tensors=tuple(found), vocab=v)


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


def _first(value: Any) -> Any:
    """A value stated one a layer (a list): the first layer's."""
    return value[0] if isinstance(value, list) and value else value


def _require(reader, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelError(f"{path} lacks the GGUF metadata key {key}; it is not a complete Llama-family GGUF")
    return value


def _expert_shape(e: GGUFTensor, experts: int, hidden: int, ffn: int) -> tuple | None:
    """What an expert's tensor (or its bias) or a router (or its bias) should be; None for
    every other tensor."""
    name = e.tensor.name
    if e.expert is not None and name.endswith(FUSED_EXPERTS):
        return 2 * ffn, hidden
    if e.expert is not None:
        down = name.endswith(("ffn_down_exps.weight", "ffn_down_exps.bias"))
        return ((hidden,) if down else (ffn,)) if name.endswith(".bias") else (hidden, ffn) if down else (ffn, hidden)
    return (experts, hidden) if name.endswith(ROUTER) else (experts,) if name.endswith("ffn_gate_inp.bias") else None


def _check_complete(have: set[str], family: Family, layers: int, path: Path, sparse: tuple = (),
                    linear: tuple | None = None, kv_sources: tuple | None = None) -> None:
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in have]
    for i in range(layers):
        required = required_layer_tensors(family, bool(linear and linear[i]), not kv_sources or kv_sources[i] == i)
        wanted = [s for s in required if not (sparse and sparse[i] and s.startswith(("ffn_gate.", "ffn_up.", "ffn_down.")))]
        fused = f"blk.{i}.{FUSED_EXPERTS}" in have
        moe = (ROUTER, "ffn_down_exps.weight", *((FUSED_EXPERTS,) if fused else ("ffn_gate_exps.weight", "ffn_up_exps.weight")))
        missing += [f"blk.{i}.{s}" for s in wanted + (list(moe) if sparse and sparse[i] else [])
                    if f"blk.{i}.{s}" not in have]
    if missing:
        raise ModelError(
            f"{path.name} lacks tensor {missing[0]} ({len(missing)} missing in all); the file is incomplete"
        )


def _delta_net_shapes(net, hidden: int) -> dict:
    """A delta-net layer's tensors under the names model/families/qwen3_5.py gives a GGUF's."""
    d = "linear_attn."
    return {d + "in_proj_qkv.weight": (net.conv_channels, hidden), d + "in_proj_z.weight": (net.values, hidden),
            d + "in_proj_b.weight": (net.value_heads, hidden), d + "in_proj_a.weight": (net.value_heads, hidden),
            d + "conv1d.weight": (net.conv_channels, net.conv_kernel), d + "dt_bias": (net.value_heads,),
            d + "decay": (net.value_heads,), d + "norm.weight": (net.value_dim,),
            d + "out_proj.weight": (hidden, net.values)}


def _hf_shapes(vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
               whole_qk_norm: bool = False) -> dict:
    """Hugging Face's shapes: by full name for the global tensors, by per-layer name otherwise
    (q/k norms over the whole projection where the family has them so)."""
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
        "self_attn.o_proj.bias": (hidden,), "self_attn.sinks": (heads,),
        "self_attn.q_norm.weight": (heads * head_dim,) if whole_qk_norm else (head_dim,),
        "self_attn.k_norm.weight": (kv_heads * head_dim,) if whole_qk_norm else (head_dim,),
        "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
        "mlp.gate_up_proj.weight": (2 * ffn, hidden),
        "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
    }
