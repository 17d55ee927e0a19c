"""Qwen3: Qwen2 without the biases, each q and k head RMS-normalised before the rotation."""

from model.families.qwen2 import Qwen2


class Qwen3(Qwen2):
    model_type, architecture, gguf_arch = "qwen3", "Qwen3ForCausalLM", "qwen3"
    attention_bias = False
    qk_norm = True


FAMILY = Qwen3()
