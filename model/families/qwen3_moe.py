"""Qwen3-MoE: Qwen3's attention, a mixture of experts in place of the MLP (but on the layers
mlp_only_layers and decoder_sparse_step leave dense), the top k's weights renormalised where
norm_topk_prob says (llama.cpp: always)."""

from model.families.family import Family


class Qwen3Moe(Family):
    model_type, architecture, gguf_arch = "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe"
    qk_norm = True
    moe = True
    gguf_top_k_normalised = True


FAMILY = Qwen3Moe()
