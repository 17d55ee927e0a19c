"""Gemma 2: the embedding scaled by sqrt(hidden), norms of (1 + w) before and after the
attention and the MLP, GeGLU, queries scaled by query_pre_attn_scalar, every other layer
sliding, soft caps on the scores and the logits. From a GGUF, what llama.cpp reads or infers
(src/models/gemma2.cpp): its norms stored as 1 + w already, the query scale from the layer
count."""

import numpy as np

from model.errors import ModelError
from model.families.family import Family, every_nth_full


class Gemma2(Family):
    model_type, architecture, gguf_arch = "gemma2", "Gemma2ForCausalLM", "gemma2"
    mlp_norm = "pre_feedforward_layernorm.weight"
    post_norms = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
    unit_offset_norms = scaled_embedding = True
    gguf_sliding_window = True
    window_pattern = 2  # every window_pattern-th layer attends to the whole context
    gguf_window = 4096  # llama.cpp's window where a GGUF gives none
    gguf_attn_softcap = True  # llama.cpp reads attn_logit_softcapping
    big_layers = 46  # the 27B's layers: its queries scaled by hidden / heads, not head_dim

    def switches(self, raw: dict, layers: int) -> dict:
        return {"query_scale": float(raw["query_pre_attn_scalar"]) ** -0.5}

    def layer_types(self, raw: dict, layers: int) -> list[str]:
        return every_nth_full(layers, self.window_pattern)

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        k = lambda name: f"{self.gguf_arch}.{name}"  # noqa: E731
        window = int(field(k("attention.sliding_window"), self.gguf_window) or 0)
        windows = None
        if window:
            pattern = field(k("attention.sliding_window_pattern"), self.window_pattern)
            if isinstance(pattern, list):  # one flag a layer
                windows = tuple(window if flag else 0 for flag in pattern)
            else:  # every pattern-th layer global
                windows = tuple(window if (i + 1) % int(pattern) else 0 for i in range(layers))
            if len(windows) != layers:
                raise ModelError(f"{k('attention.sliding_window_pattern')} has {len(windows)} flags"
                                 f" for {layers} layers")
        local = field(k("rope.freq_base_swa"))
        return {
            "layer_windows": windows,
            "local_rope_theta": float(str(np.float32(local if local else 10000.0))) if self.local_rope else None,
            "query_scale": float((hidden // heads if layers == self.big_layers else head_dim) ** -0.5),
            "attn_softcap": float(field(k("attn_logit_softcapping"), 0.0) or 0.0) if self.gguf_attn_softcap else 0.0,
            "final_softcap": float(field(k("final_logit_softcapping"), 0.0) or 0.0),
            "gelu": True,
        }

    def hf_fields(self, c) -> dict:
        fields = {"hidden_activation": "gelu_pytorch_tanh" if c.gelu else "silu",
                  "query_pre_attn_scalar": round(c.query_scale ** -2),
                  "attn_logit_softcapping": c.attn_softcap or None,
                  "final_logit_softcapping": c.final_softcap or None}
        if c.local_rope_theta is not None:
            fields["rope_local_base_freq"] = c.local_rope_theta
        return fields


FAMILY = Gemma2()
