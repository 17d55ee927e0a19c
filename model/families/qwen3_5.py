"""Qwen3.5: a hybrid of three gated delta-net layers (linear attention, model/ops/delta_rule.py)
before each full-attention layer; the full-attention layers normalise q and k per head, rotate a
quarter of each head, and gate their output by a sigmoid of a second half of q_proj; every norm
but the delta nets' gated one scales by 1 + w. Its checkpoints are vision-language models
(Qwen3_5ForConditionalGeneration) whose language model is served; the multi-token-prediction
layers (mtp.*) are not read."""

from model.errors import ModelError
from model.families.family import DeltaNet, Family

# Qwen3_5TextConfig's defaults, where a checkpoint's text_config leaves them out
TEXT_DEFAULTS = {
    "model_type": "qwen3_5_text", "vocab_size": 248_320, "hidden_act": "silu", "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": 256, "num_key_value_heads": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32}


class Qwen35(Family):
    model_type, architecture, gguf_arch = "qwen3_5_text", "Qwen3_5ForCausalLM", None
    qk_norm = True
    unit_offset_norms = True
    attention_gate = True
    wrapper_type, text_defaults = "qwen3_5", TEXT_DEFAULTS

    def switches(self, raw: dict, layers: int) -> dict:
        types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % int(raw.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(layers)]
        if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
            raise ModelError(f"config.json's layer_types ({types}) are not {layers} linear_attention or"
                             " full_attention entries")
        get = lambda key: int(raw.get(key, TEXT_DEFAULTS[key]))  # noqa: E731
        fields = dict(linear_layers=tuple(t == "linear_attention" for t in types), attention_gate=True,
                      delta_net=DeltaNet(get("linear_num_key_heads"), get("linear_num_value_heads"),
                                         get("linear_key_head_dim"), get("linear_value_head_dim"),
                                         get("linear_conv_kernel_dim")))
        rope = raw.get("rope_parameters") or {}
        if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in raw:
            fields["partial_rotary_factor"] = 0.25  # transformers' default for the family
        if fields["delta_net"].value_heads % fields["delta_net"].key_heads:
            raise ModelError("config.json's linear_num_value_heads is not a multiple of linear_num_key_heads")
        return fields


FAMILY = Qwen35()
