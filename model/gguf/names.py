"""A GGUF's tensors under their Hugging Face names, as the file's family names them: llama.cpp's
names (blk.N.attn_q.weight) are the same for every architecture, a family's Hugging Face names
differ (model/families/). Each tensor is checked against its shape; one Spool does not know
means a model it would get wrong, so it raises ModelError instead of being dropped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.errors import ModelError
from model.families import Family, gguf_family
from model.gguf.index import read_index

# a MoE layer's tensors: the router and the experts' 3-D stacks -> their part of an expert
ROUTER = "ffn_gate_inp.weight"
EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
FUSED_EXPERTS = "ffn_gate_up_exps.weight"  # gate and up in one stack (Gemma 4's): experts.E.gate_up_proj.weight
# GPT-OSS's biases beside them: the router's (1-D), the experts' (one row an expert)
EXPERT_BIASES = {"ffn_gate_inp.bias": "router", **{k.replace(".weight", ".bias"): v for k, v in EXPERT_TENSORS.items()}}

# GGUF per-layer tensor suffix -> Hugging Face per-layer name, as Llama names them
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
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that carry no weights Hugging Face needs (rope_freqs is read into
# the rope scaling instead; attn_rot_embd is an old precomputed rotary table).
_CONSUMED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


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


def layer_names(family: Family) -> dict[str, str]:
    """GGUF per-layer suffix -> the family's Hugging Face per-layer name."""
    names = {**_LAYER_TENSORS, "ffn_norm.weight": family.mlp_norm, **(family.gguf_names or {})}
    if family.post_norms:
        names["post_attention_norm.weight"], names["post_ffw_norm.weight"] = family.post_norms
    if family.qkv:
        names["attn_qkv.weight"] = family.qkv
    if family.gate_up:
        names["ffn_up.weight"] = family.gate_up
    return names


def required_layer_tensors(family: Family, linear: bool = False, keeps_kv: bool = True) -> tuple[str, ...]:
    """The GGUF per-layer suffixes every (dense) layer of the family must have; linear: a
    hybrid's delta-net layer's; keeps_kv False: a layer that reads an earlier layer's K/V (no
    k or v of its own). A family whose keys may be its values needs no attn_v."""
    own = family.gguf_names or {}
    mlp_norm = next((g for g, h in own.items() if h == family.mlp_norm), "ffn_norm.weight")
    mlp = ("ffn_up.weight",) if family.gate_up else ("ffn_gate.weight", "ffn_up.weight")
    if linear:
        return ("attn_norm.weight", *(g for g, h in own.items() if h.startswith("linear_attn.")), mlp_norm, *mlp,
                "ffn_down.weight")
    kv = ("attn_k.weight",) * keeps_kv + ("attn_v.weight",) * (keeps_kv and not family.keys_as_values)
    attn = ("attn_qkv.weight",) if family.qkv else ("attn_q.weight", *kv)
    extra = ("post_attention_norm.weight", "post_ffw_norm.weight") if family.post_norms else ()
    norms = ("attn_q_norm.weight", *("attn_k_norm.weight",) * keeps_kv) if family.qk_norm else ()
    biases = ("attn_q.bias", "attn_k.bias", "attn_v.bias") if family.attention_bias else ()
    return ("attn_norm.weight", *attn, "attn_output.weight", mlp_norm, *mlp, "ffn_down.weight", *extra,
            *norms, *biases)


def read_gguf_tensors(path: Path) -> tuple[GGUFTensor, ...]:
    """The tensors alone, as read_gguf's (loading checks their shapes against config.json),
    each GGUFTensor.tensor an index.TensorInfo: what serving the file in place needs, read from
    its header without its vocabulary (index.py)."""
    fields, infos = read_index(path)
    arch = fields.get("general.architecture")
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    family = gguf_family(arch, bool(experts), path)
    need = {name: fields.get(f"{arch}.{name}") for name in ("block_count", "attention.head_count")}
    missing = [name for name, value in need.items() if value is None]
    if missing:
        raise ModelError(f"{path} lacks the GGUF metadata key {arch}.{missing[0]}; it is not a complete Llama-family GGUF")
    heads = int(need["attention.head_count"])
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    mtp = int(fields.get(f"{arch}.nextn_predict_layers") or 0)
    return tuple(entries(infos, family, int(need["block_count"]) - mtp, heads, kv_heads, path, experts, mtp))


# the nextn tensors of a multi-token-prediction block, under a checkpoint's names (model/mtp.py)
NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
         "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}


def entries(tensors, family: Family, layers: int, heads: int, kv_heads: int, path: Path,
            experts: int = 0, mtp: int = 0) -> list[GGUFTensor]:
    """Every tensor (gguf's ReaderTensor or index.TensorInfo) under its Hugging Face name (an
    expert stack as one entry per expert, under the checkpoint's names for it); an unknown one
    means a model Spool would get wrong. The first multi-token-prediction block after the layers
    (nextn_predict_layers: Qwen3.5's) is named as layer `layers` with its nextn tensors under a
    checkpoint's mtp.* names (model/mtp.py reads them when asked); further blocks are not read."""
    names = layer_names(family)
    outer = {**_GLOBAL_TENSORS, **(family.gguf_globals or {})}
    moe = (ROUTER, *EXPERT_TENSORS, FUSED_EXPERTS, *EXPERT_BIASES) if experts else ()
    out = []
    for t in tensors:
        name = t.name
        if name in _CONSUMED or name.endswith(".attn_rot_embd"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if name in outer:
            out.append(GGUFTensor(outer[name], t, 0, shape))
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and layers <= int(parts[1]) < layers + mtp:
            if parts[2] in NEXTN and int(parts[1]) == layers:
                out.append(GGUFTensor(NEXTN[parts[2]], t, 0, shape))
            if int(parts[1]) > layers or parts[2] not in names and parts[2] not in moe:
                continue
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and (parts[2] in names or parts[2] in moe):
            i = int(parts[1])
            if i >= layers + (mtp > 0):
                raise ModelError(f"{path.name} has tensor {name} beyond its {layers} layers; the file is inconsistent")
            if parts[2] in moe:
                out += _expert_entries(t, i, parts[2], family, experts, path)
                continue
            permute = 0
            if family.gguf_rope_order and parts[2].startswith(("attn_q.", "attn_k.")):
                permute = heads if parts[2].startswith("attn_q.") else kv_heads
            out.append(GGUFTensor(f"model.layers.{i}.{names[parts[2]]}", t, permute, shape))
            continue
        raise ModelError(
            f"{path.name} has tensor {name!r}, which this converter does not know how to map;"
            " use the Hugging Face model directory instead"
        )
    return out


def _expert_entries(t, layer: int, suffix: str, family: Family, experts: int, path: Path) -> list[GGUFTensor]:
    """The router, or one entry per expert of a 3-D stack (experts outermost: each a contiguous
    slice of the tensor's bytes, GGUFTensor.expert)."""
    prefix, names = family.expert_tensors(layer)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if suffix in (ROUTER, "ffn_gate_inp.bias"):
        return [GGUFTensor(prefix + family.router + suffix[suffix.index("."):], t, 0, shape)]
    kind = ".bias" if suffix.endswith(".bias") else ".weight"
    if len(shape) != (2 if kind == ".bias" else 3) or shape[0] != experts:
        raise ModelError(f"tensor {t.name} in {path.name} has shape {shape}, not {experts} experts' matrices;"
                         " the file is inconsistent")
    name = "gate_up_proj" if suffix == FUSED_EXPERTS else names[EXPERT_TENSORS[suffix.replace(".bias", ".weight")]]
    return [GGUFTensor(f"{prefix}experts.{e}.{name}{kind}", t, 0, shape[1:], expert=e) for e in range(experts)]
