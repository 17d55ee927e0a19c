"""GPT-OSS (20B, 120B): q/k/v and output biases, a learned sink per query head (a logit
beside the scores that takes a share of the softmax and no value), every other layer sliding,
YaRN, and a mixture of experts with a biased router, biased experts and a clamped SwiGLU,
(up + 1) * gate * sigmoid(alpha * gate).

Hugging Face stacks each layer's experts in one tensor per projection, transposed, its gate and
up columns interleaved; here they become the rows Experts keeps (gate rows, then up rows, per
expert). A GGUF's experts are read through the per-expert names every MoE family has."""

import numpy as np

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

    def switches(self, raw: dict, layers: int) -> dict:
        return {"swiglu_clamp": (float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)))}

    def layer_types(self, raw: dict, layers: int) -> list[str]:
        return every_nth_full(layers, 2)

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
