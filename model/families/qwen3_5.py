"""Qwen3.5: a hybrid of three gated delta-net layers (linear attention, model/ops/delta_rule.py)
before each full-attention layer; the full-attention layers normalise q and k per head, rotate a
quarter of each head, and gate their output by a sigmoid of a second half of q_proj; every norm
but the delta nets' gated one scales by 1 + w. Its checkpoints are vision-language models
(Qwen3_5ForConditionalGeneration) whose language model is served; the multi-token-prediction
layers (mtp.*) are not read. A GGUF (src/models/qwen35.cpp) stores -exp(A_log) and the value
heads tiled over the key heads, which its config.json says (linear_value_heads_tiled)."""

from model.errors import ModelError
from model.families.family import DeltaNet, Family

# Qwen3_5TextConfig's defaults, where a checkpoint's text_config leaves them out
TEXT_DEFAULTS = {
    "model_type": "qwen3_5_text", "vocab_size": 248_320, "hidden_act": "silu", "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": 256, "num_key_value_heads": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32}

# a GGUF's per-layer tensors of its own (llama.cpp's converter); linear_attn.decay is -exp(A_log)
GGUF_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.decay", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight"}


class Qwen35(Family):
    model_type, architecture, gguf_arch = "qwen3_5_text", "Qwen3_5ForCausalLM", "qwen35"
    qk_norm = True
    unit_offset_norms = True
    attention_gate = True
    gguf_names = GGUF_NAMES
    wrapper_type, text_defaults = "qwen3_5", TEXT_DEFAULTS

    def switches(self, raw: dict, layers: int) -> dict:
        types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % int(raw.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(layers)]
        if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
            raise ModelError(f"config.json's layer_types ({types}) are not {layers} linear_attention or"
                             " full_attention entries")
        get = lambda key: int(raw.get(key, TEXT_DEFAULTS[key]))  # noqa: E731
        net = DeltaNet(get("linear_num_key_heads"), get("linear_num_value_heads"), get("linear_key_head_dim"),
                       get("linear_value_head_dim"), get("linear_conv_kernel_dim"),
                       bool(raw.get("linear_value_heads_tiled", False)))
        if net.value_heads % net.key_heads:
            raise ModelError("config.json's linear_num_value_heads is not a multiple of linear_num_key_heads")
        fields = dict(linear_layers=tuple(t == "linear_attention" for t in types), attention_gate=True, delta_net=net)
        rope = raw.get("rope_parameters") or {}
        if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in raw:
            fields["partial_rotary_factor"] = 0.25  # transformers' default for the family
        return fields

    def gguf_mixers(self, field, layers: int) -> tuple[bool, ...]:
        flags = field(f"{self.gguf_arch}.attention.recurrent_layers")
        if flags is not None:
            return tuple(bool(f) for f in flags[:layers])
        interval = int(field(f"{self.gguf_arch}.full_attention_interval", 4))
        return tuple((i + 1) % interval != 0 for i in range(layers))

    def gguf_switches(self, field, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        k = lambda name: f"{self.gguf_arch}.ssm.{name}"  # noqa: E731
        missing = [name for name in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")
                   if field(k(name)) is None]
        if missing:
            raise ModelError(f"the GGUF lacks {k(missing[0])}: not a complete Qwen3.5 GGUF")
        value_heads = int(field(k("time_step_rank")))
        net = DeltaNet(int(field(k("group_count"))), value_heads, int(field(k("state_size"))),
                       int(field(k("inner_size"))) // value_heads, int(field(k("conv_kernel"))), tiled=True)
        return dict(linear_layers=self.gguf_mixers(field, layers), attention_gate=True, delta_net=net)

    def hf_fields(self, c) -> dict:
        net = c.delta_net
        return {"layer_types": ["linear_attention" if c.linear(i) else "full_attention" for i in range(c.num_layers)],
                "linear_num_key_heads": net.key_heads, "linear_num_value_heads": net.value_heads,
                "linear_key_head_dim": net.key_dim, "linear_value_head_dim": net.value_dim,
                "linear_conv_kernel_dim": net.conv_kernel, "linear_value_heads_tiled": net.tiled}


FAMILY = Qwen35()
