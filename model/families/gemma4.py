"""Gemma 4 (E2B, E4B, 26B-A4B, 31B), as transformers' Gemma4TextModel and llama.cpp's
src/models/gemma4.cpp run it: Gemma 3's sandwich norms (of w, not 1 + w), GeGLU, q/k norms, five
of six layers sliding; and besides

- full layers with their own head size (global_head_dim) and, where their keys are their values
  (attention_k_eq_v: no v_proj), their own K/V heads; they rotate a quarter of each head's pairs
  at the head's frequencies ("proportional"), the sliding ones all at their own theta;
- v RMS-normalised without a weight, and scores unscaled (the norms set the queries' size);
- the last num_kv_shared_layers layers keep no K/V: each reads the last earlier layer's of its
  kind, and their MLPs are twice as wide where use_double_wide_mlp;
- per-layer embeddings (E2B, E4B): a second table of a small slice per layer per token, plus
  a projection of the embedding, feeding a gated residual at each layer's end;
- each layer's output times a learned scalar; the logits soft-capped;
- 26B-A4B: experts beside the dense MLP, routed on the stream's own norm, each expert's output
  times a learned scale (Experts.expert_scale, on its routing weight).

Its checkpoints are vision-language models (Gemma4ForConditionalGeneration) whose language
model is served. Its GGUFs are read as conversion/gemma.py's Gemma4Model writes them
(gguf_switches).
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from model.errors import ModelError
from model.families.family import Family, every_nth_full
from model.quant.quantized import float32

# Gemma4TextConfig's defaults: a Gemma4ForConditionalGeneration config.json's text_config gives
# only where they differ
TEXT_DEFAULTS = {
    "model_type": "gemma4_text", "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "global_head_dim": 512, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512, "bos_token_id": 2, "eos_token_id": 1,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}}}


@dataclass
class PerLayerInput:
    """One layer's use of Gemma 4's per-layer embeddings: gelu(gate @ x) times the layer's slice of
    them, projected back to the stream's width, normalised, added to the stream."""

    gate: np.ndarray  # (per_layer_input, hidden)
    proj: np.ndarray  # (hidden, per_layer_input)
    norm: np.ndarray  # (hidden,)

    def prepared(self, prepare: Callable, keep_float: Callable) -> "PerLayerInput":
        return PerLayerInput(prepare(self.gate), prepare(self.proj), prepare(self.norm))

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values())


@dataclass
class ExpertNorms:
    """The norms around experts that run beside a dense MLP (Gemma 4): the router's input (the
    stream's RMS times its scale and hidden ** -0.5), the experts' input, and each output's norm
    before the two are summed."""

    router: np.ndarray  # (hidden,)
    experts_in: np.ndarray
    mlp_out: np.ndarray
    experts_out: np.ndarray

    def prepared(self, prepare: Callable, keep_float: Callable) -> "ExpertNorms":
        return ExpertNorms(*(prepare(v) for v in vars(self).values()))

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values())


@dataclass
class PerLayerEmbedding:
    """Gemma 4's per-layer embeddings: a table of every layer's slice per token, and a projection
    of the (scaled) embedding beside it, normalised per slice; their sum feeds each layer."""

    table: np.ndarray  # (per_layer_vocab, layers x per_layer_input)
    proj: np.ndarray  # (layers x per_layer_input, hidden), times hidden ** -0.5
    norm: np.ndarray  # (per_layer_input,), times 2 ** -0.5 (the sum's scale, applied to both parts)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values())


def shared_kv_sources(types: list[str], shared: int) -> tuple[int, ...] | None:
    """The layer whose K/V each layer reads: its own, but in the last `shared` layers the last
    earlier layer of its kind (sliding or full)."""
    if not shared:
        return None
    first, sources = len(types) - shared, list(range(len(types)))
    for i in range(first, len(types)):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ModelError(f"layer {i} ({types[i]}) reads an earlier layer's K/V, but no earlier layer of its kind"
                             " keeps any; the model's config is inconsistent")
        sources[i] = owners[-1]
    return tuple(sources)


class Gemma4(Family):
    model_type, architecture, gguf_arch = "gemma4_text", "Gemma4ForCausalLM", "gemma4"
    gguf_sliding_window = True
    gguf_names = {"layer_output_scale.weight": "layer_scalar", "inp_gate.weight": "per_layer_input_gate.weight",
                  "proj.weight": "per_layer_projection.weight", "post_norm.weight": "post_per_layer_input_norm.weight",
                  "ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
                  "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
                  "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
                  "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight"}
    gguf_top_k_normalised = True
    gguf_globals = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
    qk_norm = True
    keys_as_values = True
    mlp_norm = "pre_feedforward_layernorm.weight"
    post_norms = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
    scaled_embedding = True
    moe = True
    expert_prefix = ""
    router = "router.proj"
    top_k_normalised = True  # the softmax over all experts, its top k renormalised
    wrapper_type, text_defaults = "gemma4", TEXT_DEFAULTS

    def raw_config(self, raw: dict) -> dict:
        """Experts only where enable_moe_block, their top k under the common key; layer_types
        as transformers fills them (every sixth full, the last always full)."""
        if raw.get("use_bidirectional_attention") == "all":
            raise ModelError("config.json sets use_bidirectional_attention: all (an encoder), which Spool does"
                             " not serve")
        raw = dict(raw)
        if raw.get("enable_moe_block"):
            raw["num_experts_per_tok"] = raw.get("top_k_experts") or raw["num_experts_per_tok"]
        else:
            raw.pop("num_experts", None)
        layers = int(raw["num_hidden_layers"])
        types = list(raw.get("layer_types") or every_nth_full(layers, 6))
        raw["layer_types"] = types[:-1] + ["full_attention"]
        return raw

    def switches(self, raw: dict, layers: int) -> dict:
        types = raw["layer_types"]
        full = [t == "full_attention" for t in types]
        sliding = (int(raw.get("num_key_value_heads") or raw["num_attention_heads"]), int(raw["head_dim"]))
        overrides = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items()}  # transformers 5.23's
        if not overrides:  # the released config.json's spelling
            override = {"head_dim": raw.get("global_head_dim", 512)}
            if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads"):
                override["num_key_value_heads"] = raw["num_global_key_value_heads"]
            overrides = {i: override for i in range(layers) if full[i]}
        heads = tuple((int(overrides.get(i, {}).get("num_key_value_heads", sliding[0])),
                       int(overrides.get(i, {}).get("head_dim", sliding[1]))) for i in range(layers))
        shared = int(raw.get("num_kv_shared_layers") or 0)
        width = int(raw["intermediate_size"])
        widths = tuple(2 * width if i >= layers - shared and raw.get("use_double_wide_mlp") else width
                       for i in range(layers))
        per_layer = int(raw.get("hidden_size_per_layer_input") or 0)
        return {"query_scale": 1.0, "layer_heads": heads, "kv_sources": shared_kv_sources(types, shared),
                "value_norm": True, "layer_widths": widths if len(set(widths)) > 1 else None,
                "per_layer_input": per_layer,
                "per_layer_vocab": int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]) if per_layer else 0,
                "experts_beside_mlp": bool(raw.get("enable_moe_block"))}

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        """As llama.cpp's converter writes them (conversion/gemma.py, Gemma4Model): key_length the
        full layers' head size, key_length_swa the sliding ones'; head_count_kv and
        feed_forward_length one a layer where layers differ; a flag a layer for the window. (Its
        rope_freqs tensor is the proportional rotation: model/gguf/rope.py.)"""
        k = lambda name: f"{self.gguf_arch}.{name}"  # noqa: E731
        pattern = field(k("attention.sliding_window_pattern"))
        if not isinstance(pattern, list) or len(pattern) != layers or all(pattern):
            raise ModelError(f"{k('attention.sliding_window_pattern')} is not a flag a layer with a full layer among"
                             " them; the file is inconsistent")
        kv, widths = (tuple(int(v) for v in (value if isinstance(value, list) else [value] * layers))
                      for value in (field(k("attention.head_count_kv"), heads), field(k("feed_forward_length"))))
        swa_dim = int(field(k("attention.key_length_swa"), head_dim))
        layer_heads = tuple((kv[i], swa_dim if pattern[i] else head_dim) for i in range(layers))
        window = int(field(k("attention.sliding_window"), 0) or 0)
        types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
        return {"head_dim": swa_dim, "num_kv_heads": kv[pattern.index(True)] if any(pattern) else kv[0],
                "intermediate_size": widths[0], "layer_heads": layer_heads,
                "kv_sources": shared_kv_sources(types, int(field(k("attention.shared_kv_layers"), 0) or 0)),
                "layer_widths": widths if len(set(widths)) > 1 else None,
                "layer_windows": tuple(window if flag else 0 for flag in pattern),
                "local_rope_theta": float(str(np.float32(field(k("rope.freq_base_swa"), 10000.0)))),
                "query_scale": 1.0, "value_norm": True, "gelu": True,
                "final_softcap": float(field(k("final_logit_softcapping"), 0.0) or 0.0),
                "per_layer_input": int(field(k("embedding_length_per_layer_input"), 0) or 0),
                "experts_beside_mlp": bool(field(k("expert_count")))}

    def gguf_shapes(self, switches: dict, hidden: int, layers: int, vocab: int, experts: int = 0) -> dict:
        P = switches["per_layer_input"]
        moe = {"router.scale": (hidden,), "router.per_expert_scale": (experts,),
               **{norm: (hidden,) for norm in ("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                                                "post_feedforward_layernorm_2.weight")}} if experts else {}
        shapes = {"layer_scalar": (1,), **moe}
        if P:
            shapes.update({"per_layer_input_gate.weight": (P, hidden), "per_layer_projection.weight": (hidden, P),
                           "post_per_layer_input_norm.weight": (hidden,),
                           "model.embed_tokens_per_layer.weight": (vocab, layers * P),
                           "model.per_layer_model_projection.weight": (layers * P, hidden),
                           "model.per_layer_projection_norm.weight": (P,)})
        return shapes

    def hf_fields(self, c) -> dict:
        """transformers 5.23's spelling: each full layer's head size and K/V heads in per_layer_config."""
        windows = c.layer_windows
        shared = sum(c.kv_source(i) != i for i in range(c.num_layers))
        return {"hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": c.final_softcap or None,
                "per_layer_config": {str(i): {"head_dim": c.head_dim_of(i), "num_key_value_heads": c.kv_heads_of(i)}
                                     for i in range(c.num_layers) if not windows[i]},
                "num_kv_shared_layers": shared, "use_double_wide_mlp": c.layer_widths is not None,
                "hidden_size_per_layer_input": c.per_layer_input, "enable_moe_block": bool(c.num_experts),
                "vocab_size_per_layer_input": c.per_layer_vocab or c.vocab_size,
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta},
                                    "full_attention": {"rope_type": "proportional", "rope_theta": c.rope_theta,
                                                       "partial_rotary_factor": c.partial_rotary_factor}}}

    def stacked_experts(self, read, layer: int, experts: int, hidden: int, inner: int) -> dict | None:
        """A checkpoint's experts stacked (gate rows, then up rows, per expert, as Experts keeps
        them), and each expert's learned scale; None for a GGUF's (read per expert: its gate and
        up fused, its scale beside them)."""
        p = f"model.layers.{layer}."
        scale = read(p + "router.per_expert_scale", (experts,))
        gate_up = read(p + "experts.gate_up_proj", (experts, 2 * inner, hidden))
        if gate_up is None:
            return {"expert_scale": scale}
        return dict(gate_up=gate_up.reshape(-1, hidden), expert_scale=scale,
                    down=read(p + "experts.down_proj", (experts, hidden, inner)).reshape(-1, inner))

    def layer_extras(self, reader, layer: int) -> dict:
        c, p = reader.config, f"model.layers.{layer}."
        H, P = c.hidden_size, c.per_layer_input
        out = {"scalar": float(float32(reader.take(p + "layer_scalar", (1,)))[0])}
        if P:
            out["per_layer"] = PerLayerInput(gate=reader.take(p + "per_layer_input_gate.weight", (P, H)),
                                             proj=reader.take(p + "per_layer_projection.weight", (H, P)),
                                             norm=reader.norm(p + "post_per_layer_input_norm.weight", (H,)))
        if c.experts_beside_mlp:
            out["expert_norms"] = ExpertNorms(
                router=float32(reader.take(p + "router.scale", (H,))) * np.float32(H ** -0.5),
                experts_in=reader.norm(p + "pre_feedforward_layernorm_2.weight", (H,)),
                mlp_out=reader.norm(p + "post_feedforward_layernorm_1.weight", (H,)),
                experts_out=reader.norm(p + "post_feedforward_layernorm_2.weight", (H,)))
        return out

    def outer_extras(self, reader, prepare: Callable) -> dict:
        c = reader.config
        if not c.per_layer_input:
            return {}
        H, P, L = c.hidden_size, c.per_layer_input, c.num_layers
        return {"per_layer": PerLayerEmbedding(
            table=prepare(reader.unread("model.embed_tokens_per_layer.weight", (c.per_layer_vocab or c.vocab_size, L * P))),
            proj=prepare(float32(reader.take("model.per_layer_model_projection.weight", (L * P, H)))
                         * np.float32(H ** -0.5)),
            norm=prepare(float32(reader.norm("model.per_layer_projection_norm.weight", (P,))) * np.float32(0.5 ** 0.5)))}


FAMILY = Gemma4()
