"""GPT-OSS (20B, 120B): q/k/v and output biases, a learned sink per query head (a logit
beside the scores that takes a share of the softmax and no value), every other layer sliding,
YaRN, and a mixture of experts with a biased router, biased experts and a clamped SwiGLU,
(up + 1) * gate * sigmoid(alpha * gate).

Hugging Face stacks each layer's experts in one tensor per projection, transposed, its gate and
up columns interleaved; here they become the rows Experts keeps (gate rows, then up rows, per
expert). A GGUF's experts are read through the per-expert names every MoE family has, their
biases beside them; its YaRN is read unrounded, as the model was trained, where llama.cpp
rounds the correction range (a difference within a few dimensions' rotation)."""

import numpy as np

from model.errors import ModelError
from model.families.family import Family, every_nth_full


class GptOss(Family):
    model_type, architecture, gguf_arch = "gpt_oss", "GptOssForCausalLM", "gpt-oss"
    attention_bias = True
    attention_sinks = True
    moe = True
    experts_key = "num_local_experts"
    router = "router"
    top_k_normalised = True  # the softmax of the top k's logits: their probabilities renormalised
    default_rope_theta = 150000.0
    gguf_sliding_window = True
    gguf_top_k_normalised = True
    gguf_yarn_truncate = False  # trained so (transformers' truncate: false), though llama.cpp rounds
    gguf_names = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                  "attn_sinks.weight": "self_attn.sinks", "attn_output.bias": "self_attn.o_proj.bias"}
    gguf_clamp = (1.702, 7.0)  # llama.cpp's, fixed for GPT-OSS: its converter writes neither

    def switches(self, raw: dict, layers: int) -> dict:
        return {"swiglu_clamp": (float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)))}

    def layer_types(self, raw: dict, layers: int) -> list[str]:
        return every_nth_full(layers, 2)

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        """The window on the even layers, as llama.cpp lays it out (a pattern of 2); the clamp's
        limit where the file states one (swiglu_clamp_exp, llama.cpp's key for other families),
        else the released models'."""
        window = int(field(f"{self.gguf_arch}.attention.sliding_window", 0) or 0)
        windows = tuple(window if t == "sliding_attention" else 0 for t in every_nth_full(layers, 2))
        limit = field(f"{self.gguf_arch}.swiglu_clamp_exp")
        limits = set(np.atleast_1d(np.asarray(limit, dtype=np.float32)).tolist()) if limit is not None else set()
        if len(limits) > 1:
            raise ModelError(f"{self.gguf_arch}.swiglu_clamp_exp differs between layers ({sorted(limits)}),"
                             " which Spool does not run")
        alpha, default = self.gguf_clamp
        clamp = (alpha, float(str(np.float32(limits.pop()))) if limits else default)
        return {"layer_windows": windows if window else None, "swiglu_clamp": clamp}

    def stacked_experts(self, read, layer: int, experts: int, hidden: int, inner: int) -> dict | None:
        """read(name, shape): the tensor as float32, None where the checkpoint lacks it."""
        m = f"model.layers.{layer}.mlp.experts."
        gate_up = read(m + "gate_up_proj", (experts, hidden, 2 * inner))
        if gate_up is None:
            return None
        order = np.concatenate([np.arange(0, 2 * inner, 2), np.arange(1, 2 * inner, 2)])  # gates, then ups
        return dict(gate_up=np.ascontiguousarray(gate_up.transpose(0, 2, 1)[:, order]).reshape(-1, hidden),
                    gate_up_bias=read(m + "gate_up_proj_bias", (experts, 2 * inner))[:, order].ravel(),
                    down=np.ascontiguousarray(read(m + "down_proj", (experts, inner, hidden)).transpose(0, 2, 1))
                    .reshape(-1, inner),
                    down_bias=read(m + "down_proj_bias", (experts, hidden)).ravel())

    def hf_fields(self, c) -> dict:
        alpha, limit = c.swiglu_clamp
        return {"swiglu_alpha": alpha, "swiglu_limit": limit}


FAMILY = GptOss()
