"""Phi-3 (and Phi-4-mini): q/k/v stored as one qkv_proj and gate/up as one gate_up_proj;
LongRoPE and partial rotation come from config.json as for any family. A GGUF's sliding window
is ignored, as llama.cpp ignores it."""

from model.families.family import Family


class Phi3(Family):
    model_type, architecture, gguf_arch = "phi3", "Phi3ForCausalLM", "phi3"
    qkv, gate_up = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
    gguf_sliding_window = True


FAMILY = Phi3()
