"""Llama (1, 2, 3, and SmolLM2 and the rest written as it): every default of Family."""

from model.families.family import Family


class Llama(Family):
    model_type, architecture, gguf_arch = "llama", "LlamaForCausalLM", "llama"
    gguf_rope_order = True

    def hf_fields(self, c) -> dict:
        return {"mlp_bias": False}


FAMILY = Llama()
