"""OLMoE: q and k RMS-normalised over the whole projection (not per head), a mixture of experts
in place of every MLP, the top k's weights as the softmax gave them."""

from model.families.family import Family


class Olmoe(Family):
    model_type, architecture, gguf_arch = "olmoe", "OlmoeForCausalLM", "olmoe"
    qk_norm = qk_norm_whole = True
    moe = True


FAMILY = Olmoe()
