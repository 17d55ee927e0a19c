"""Gemma 3: Gemma 2 with q/k norms, five of six layers sliding, those layers rotating by their
own theta (unscaled), no cap on the scores; its 4B-27B checkpoints are vision-language models
(Gemma3ForConditionalGeneration) whose language model is served (src/models/gemma3.cpp for a
GGUF's)."""

from model.families.family import every_nth_full
from model.families.gemma2 import Gemma2

# Gemma3TextConfig's defaults: a Gemma 3 4B-27B config.json (Gemma3ForConditionalGeneration)
# gives its text_config only where they differ
TEXT_DEFAULTS = {
    "model_type": "gemma3_text", "vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1}


class Gemma3(Gemma2):
    model_type, architecture, gguf_arch = "gemma3_text", "Gemma3ForCausalLM", "gemma3"
    qk_norm = True
    default_rope_theta = 1e6
    local_rope = True
    window_pattern = 6
    gguf_window = 0
    gguf_attn_softcap = False
    big_layers = 62
    wrapper_type, text_defaults = "gemma3", TEXT_DEFAULTS

    def layer_types(self, raw: dict, layers: int) -> list[str]:
        return every_nth_full(layers, int(raw.get("sliding_window_pattern", self.window_pattern)))


FAMILY = Gemma3()
