"""Qwen2: q/k/v biases; sliding windows, where use_sliding_window says, from layer
max_window_layers on."""

from model.families.family import Family


class Qwen2(Family):
    model_type, architecture, gguf_arch = "qwen2", "Qwen2ForCausalLM", "qwen2"
    attention_bias = True

    def layer_types(self, raw: dict, layers: int) -> list[str]:
        first = int(raw.get("max_window_layers", layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]

    def hf_fields(self, c) -> dict:
        return {"use_sliding_window": False}


FAMILY = Qwen2()
