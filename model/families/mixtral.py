"""Mixtral: Mistral with a mixture of experts in place of each MLP, its experts' matrices named
w1 (gate), w3 (up) and w2 (down), the top k's weights always renormalised. llama.cpp writes its
GGUFs as architecture llama with experts."""

from model.families.family import Family


class Mixtral(Family):
    model_type, architecture, gguf_arch = "mixtral", "MixtralForCausalLM", "llama"
    gguf_rope_order = True
    moe = True
    experts_key = "num_local_experts"
    expert_prefix, expert_names = "block_sparse_moe.", ("w1", "w3", "w2")
    top_k_normalised = gguf_top_k_normalised = True


FAMILY = Mixtral()
