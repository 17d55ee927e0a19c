"""Ministral 3 (3B, 8B, 14B): Mistral's shape with YaRN and Llama 4's attention temperature,
queries times 1 + beta * log(1 + floor(position / original context)) past the trained context
(1 before it). Its checkpoints are vision-language models (Mistral3ForConditionalGeneration)
whose language model is served; so are Mistral Small 3.x's, whose text_config is plain
Mistral's (no temperature, no YaRN: the same forward pass). llama.cpp writes them as
architecture mistral3, q/k rows in its rope order, beta as attention.temperature_scale."""

from model.families.family import Family

# Ministral3Config's defaults, where a wrapper's text_config leaves them out
TEXT_DEFAULTS = {
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


class Ministral3(Family):
    model_type, architecture, gguf_arch = "ministral3", "Ministral3ForCausalLM", "mistral3"
    gguf_rope_order = True
    default_rope_theta = 1e6
    wrapper_type, text_defaults = "mistral3", TEXT_DEFAULTS

    def switches(self, raw: dict, layers: int) -> dict:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        beta = params.get("llama_4_scaling_beta")
        if not beta:
            return {}
        return {"attention_temperature": (float(beta), int(params["original_max_position_embeddings"]))}

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        beta = field(f"{self.gguf_arch}.attention.temperature_scale")
        original = field(f"{self.gguf_arch}.rope.scaling.original_context_length")
        return {"attention_temperature": (float(beta), int(original))} if beta and original else {}

    def hf_fields(self, c) -> dict:
        if c.attention_temperature is None:
            return {}
        beta, original = c.attention_temperature
        return {"rope_scaling": {**(c.rope_scaling or {}), "llama_4_scaling_beta": beta,
                                 "original_max_position_embeddings": original}}


FAMILY = Ministral3()
