"""Qwen3.5-MoE: Qwen3.5's hybrid layers with a mixture of experts in every MLP (softmax top k,
renormalised) and a shared expert beside them, its output gated by a sigmoid of its own
one-row projection (src/models/qwen35moe.cpp for a GGUF's)."""

from model.families.qwen3_5 import GGUF_NAMES, TEXT_DEFAULTS, Qwen35

# a GGUF's shared expert, beside the routed ones' names every mixture shares
SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}


class Qwen35Moe(Qwen35):
    model_type, architecture, gguf_arch = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "qwen35moe"
    moe = True
    top_k_normalised = True
    gguf_top_k_normalised = True
    gguf_names = {**GGUF_NAMES, **SHARED_EXPERT_NAMES}
    wrapper_type = "qwen3_5_moe"
    text_defaults = {**TEXT_DEFAULTS, "model_type": "qwen3_5_moe_text", "num_key_value_heads": 2,
                     "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
                     "num_experts_per_tok": 8}

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        shared = field(f"{self.gguf_arch}.expert_shared_feed_forward_length")
        return {**super().gguf_switches(field, layers, hidden, heads, head_dim),
                "shared_expert_size": int(shared or 0)}

    def hf_fields(self, c) -> dict:
        return {**super().hf_fields(c), "shared_expert_intermediate_size": c.shared_expert_size}


FAMILY = Qwen35Moe()
