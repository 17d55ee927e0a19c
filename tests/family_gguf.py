"""The family checkpoints of tools/family_models.py written as GGUF files the way llama.cpp's
converter writes them (conversion/gemma.py, phi.py, qwen.py of the llama.cpp that
llama-cpp-python 0.3.36 bundles): its tensor names (gguf-py's own map), Gemma's norms stored
as 1 + w, Phi-3's LongRoPE factors as tensors, what llama.cpp infers left out. F32 tensors, so
the file's values are the checkpoint's, and the transformers fixtures hold for it too (or
quantized matrices, served packed).
"""

from pathlib import Path

import gguf
import numpy as np

from family_models import FAMILIES, mtp_tensors, random_tensors

ARCHES = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
          "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "smollm3": gguf.MODEL_ARCH.SMOLLM3,
          "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
          "qwen3_5_text": gguf.MODEL_ARCH.QWEN35, "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE,
          "gpt_oss": gguf.MODEL_ARCH.GPT_OSS, "ministral3": gguf.MODEL_ARCH.MISTRAL3}
ROPE_ORDER = ("smollm3", "mixtral", "ministral3")  # llama.cpp's converter permutes q/k rows of these (architecture llama)


def experts_stacked(tensors: dict[str, np.ndarray], experts: int) -> dict[str, np.ndarray]:
    """Each layer's per-expert matrices as one (experts, rows, columns) stack, under the name
    llama.cpp's converter stacks them by (model.layers.N.mlp.experts.gate_proj.weight, ...)."""
    out, stacks = {}, {}
    for name, array in tensors.items():
        parts = name.split(".")
        if "experts" not in parts:
            out[name] = array
            continue
        at = parts.index("experts")
        stacks.setdefault(".".join(parts[:at + 1] + parts[at + 2:]), {})[int(parts[at + 1])] = array
    for name, by_expert in stacks.items():
        out[name] = np.stack([by_expert[e] for e in range(experts)])
    return out


def qwen35_tensors(c: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen3.5's tensors as llama.cpp's converter writes them (conversion/qwen.py: Qwen3NextModel
    and _LinearAttentionVReorderBase): norms as 1 + w but the delta nets' gated one, -exp(A_log),
    dt_bias as dt_proj.bias, the convolution squeezed, and the value heads reordered from grouped
    by key head to tiled over the key heads, wherever they index rows, columns or channels."""
    keys, per = c["linear_num_key_heads"], c["linear_num_value_heads"] // c["linear_num_key_heads"]
    key_dim, value_dim = c["linear_key_head_dim"], c["linear_value_head_dim"]

    def tiled(a: np.ndarray, size: int, axis: int = 0) -> np.ndarray:
        a = np.moveaxis(a, axis, 0)
        a = a.reshape(keys, per, size, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        return np.moveaxis(a, 0, axis)

    out = {}
    for name, a in tensors.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            a = a + np.float32(1.0)
        if "linear_attn." in name:
            qk = 2 * keys * key_dim
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                a = a.reshape(a.shape[0], -1) if name.endswith("conv1d.weight") else a
                a = np.concatenate([a[:qk], tiled(a[qk:], value_dim)])
            elif name.endswith("in_proj_z.weight"):
                a = tiled(a, value_dim)
            elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
                a = tiled(a, 1)
            elif name.endswith("out_proj.weight"):
                a = tiled(a, value_dim, axis=1)
            if name.endswith("A_log"):
                a = -np.exp(a)
            name = name.replace(".dt_bias", ".dt_proj.bias")
        if name.endswith("shared_expert_gate.weight"):
            a = a.reshape(-1)  # llama.cpp's is 1-D
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def gpt_oss_tensors(c: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-OSS's tensors under llama.cpp's names, as its converter writes them (conversion of
    GptOssForCausalLM): each stacked gate_up split into gate and up stacks (its interleaved
    columns apart) and every expert stack transposed to (experts, rows, columns)."""
    out = {}
    for name, a in tensors.items():
        if not name.startswith("model.layers."):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = a
            continue
        _, _, i, rest = name.split(".", 3)
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj":
            out[blk + "ffn_gate_exps.weight"] = a[:, :, 0::2].transpose(0, 2, 1)
            out[blk + "ffn_up_exps.weight"] = a[:, :, 1::2].transpose(0, 2, 1)
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = a[:, 0::2], a[:, 1::2]
        elif rest == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = a.transpose(0, 2, 1)
        else:
            out[blk + {"input_layernorm.weight": "attn_norm.weight",
                       "post_attention_layernorm.weight": "post_attention_norm.weight",
                       "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                       "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
                       **{f"self_attn.{x}_proj.{kind}": f"attn_{y}.{kind}" for x, y in
                          (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")}}[rest]] = a
    return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in out.items()}


def byte_tokens() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of exactly 256 tokens (255 bytes and one merge), and its merge."""
    from tokenizers import pre_tokenizers

    alphabet = [t for t in sorted(pre_tokenizers.ByteLevel.alphabet()) if t not in "Ġt"]
    return ["Ġ", "t", *alphabet[:253], "Ġt"], ["Ġ t"]


def add_byte_vocab(w: gguf.GGUFWriter, c: dict) -> None:
    """byte_tokens' vocabulary, and the family's BOS and EOS."""
    tokens, merges = byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])


def write_gemma4_gguf(c: dict, path: Path, quant: gguf.GGMLQuantizationType | None) -> Path:
    """A Gemma 4 as conversion/gemma.py's Gemma4Model writes it: key_length the full
    layers' head size and key_length_swa the sliding ones'; K/V heads and MLP widths one a layer
    where they differ; a window flag a layer; its norms as they are (w, not 1 + w); layer_scalar
    as layer_output_scale.weight; the proportional rotation as a rope_freqs tensor of 1 for the
    turning pairs and 1e30 for the rest; experts as fused gate_up and down stacks, the router's
    scale as ffn_gate_inp.scale and each expert's as ffn_down_exps.scale."""
    arch, layers = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA4], c["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), arch)
    full, sliding = c["rope_parameters"]["full_attention"], c["rope_parameters"]["sliding_attention"]
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    shared = c.get("num_kv_shared_layers", 0)
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    width = c["intermediate_size"]
    if c.get("use_double_wide_mlp"):
        w.add_feed_forward_length([width if i < layers - shared else 2 * width for i in range(layers)])
    else:
        w.add_feed_forward_length(width)
    w.add_head_count(c["num_attention_heads"])
    if c.get("num_global_key_value_heads"):
        w.add_head_count_kv([c["num_key_value_heads"] if s else c["num_global_key_value_heads"] for s in swa])
    else:
        w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["global_head_dim"])
    w.add_value_length(c["global_head_dim"])
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_float32(f"{arch}.rope.freq_base_swa", sliding["rope_theta"])
    w.add_rope_dimension_count(c["global_head_dim"])
    w.add_rope_dimension_count_swa(c["head_dim"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input") or 0)
    if c.get("enable_moe_block"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["top_k_experts"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    add_byte_vocab(w, c)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    scales = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
    for hf, array in random_tensors(c).items():
        hf = hf + ".weight" if hf.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")) else hf
        own = next((g for h, g in scales.items() if hf.endswith(h)), None)
        gguf_name = f"blk.{hf.split('.')[2]}.{own}" if own else names.get_name(hf, try_suffixes=(".weight",))
        keep = "embed_tokens" in hf or "router" in hf or array.shape[-1] % 32  # llama.cpp keeps routers F32
        if quant is not None and array.ndim >= 2 and not keep:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name, array)
    turning = int(full["partial_rotary_factor"] * c["global_head_dim"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (c["global_head_dim"] // 2 - turning),
                                               dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_family_gguf(name: str, path: Path, quant: gguf.GGMLQuantizationType | None = None, mtp: bool = False) -> Path:
    """quant: the type of every matrix but the embedding (F32 for the rest). mtp: the
    multi-token-prediction layer of family_models.mtp_tensors after the layers, as llama.cpp's
    converter writes Qwen3.5's (block_count one more, nextn_predict_layers 1, its layer's
    tensors under blk.N and its own as blk.N.nextn.*)."""
    c, _ = FAMILIES[name]
    kind = c["model_type"]
    if kind == "gemma4_text":
        return write_gemma4_gguf(c, path, quant)
    arch = gguf.MODEL_ARCH_NAMES[ARCHES[kind]]
    w = gguf.GGUFWriter(str(path), arch)
    heads, rope = c["num_attention_heads"], c.get("rope_parameters") or c.get("rope_scaling") or {}
    w.add_block_count(c["num_hidden_layers"] + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if c.get("intermediate_size"):  # none where every layer routes (Qwen3.5-MoE)
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta") or c["rope_theta"])
    partial = c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(partial * c["head_dim"]))
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
        if "moe_intermediate_size" in c:
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    extra = {}
    kind_of = rope.get("rope_type", rope.get("type"))
    if kind_of == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind_of == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind_of == "longrope":
        original = c["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        extra = {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                 "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    if kind == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    if kind == "gemma3_text":
        w.add_sliding_window(c["sliding_window"])
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", c["sliding_window_pattern"])
        w.add_float32(f"{arch}.rope.freq_base_swa", c["rope_local_base_freq"])
    if kind == "ministral3":  # as llama.cpp's conversion/mistral3.py writes them
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if kind == "gpt_oss":
        w.add_sliding_window(c["sliding_window"])
        w.add_expert_feed_forward_length(c["intermediate_size"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_float32(f"{arch}.swiglu_clamp_exp", c["swiglu_limit"])  # the released models' 7 is implied
    if "shared_expert_intermediate_size" in c:
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if kind.startswith("qwen3_5"):
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(c["linear_key_head_dim"])
        w.add_ssm_group_count(c["linear_num_key_heads"])
        w.add_ssm_time_step_rank(c["linear_num_value_heads"])
        w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        w.add_full_attention_interval(c["layer_types"].index("full_attention") + 1)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    add_byte_vocab(w, c)
    names = gguf.get_tensor_name_map(ARCHES[kind], c["num_hidden_layers"] + mtp)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c["num_hidden_layers"])
    tensors = random_tensors(c)
    nextn = {}
    if mtp:  # conversion/qwen.py's renaming: the layer as layer N, the rest as its nextn tensors
        n = c["num_hidden_layers"]
        for name, array in mtp_tensors(c).items():
            if name.startswith("mtp.layers.0."):
                tensors[f"model.layers.{n}.{name[len('mtp.layers.0.'):]}"] = array
            else:  # its norms stored as 1 + w, as the others
                own = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                       "norm": "shared_head_norm"}[name.split(".")[1]]
                nextn[f"blk.{n}.nextn.{own}.weight"] = array if own == "eh_proj" else array + np.float32(1.0)
    if kind.startswith("qwen3_5"):
        tensors = qwen35_tensors(c, tensors)
    extra.update(nextn)
    if kind == "gpt_oss":  # under llama.cpp's names already
        for gguf_name, array in gpt_oss_tensors(c, tensors).items():
            quantized = quant is not None and array.ndim >= 2 and gguf_name.endswith("exps.weight")
            w.add_tensor(gguf_name, gguf.quants.quantize(array, quant) if quantized else array,
                         raw_dtype=quant if quantized else None)
        tensors = {}
    for hf, array in (experts_stacked(tensors, experts) if experts else tensors).items():
        if kind.startswith("gemma") and hf.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if kind in ROPE_ORDER and (".q_proj." in hf or ".k_proj." in hf):  # llama.cpp's rope row order
            n = heads if ".q_proj." in hf else c["num_key_value_heads"]
            array = array.reshape(n, 2, -1, array.shape[1]).swapaxes(1, 2).reshape(array.shape)
        # Qwen3-MoE's dense layers (mlp_only_layers), which llama.cpp's qwen3moe lacks: llama's names
        gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias")) or dense.get_name(hf, (".weight",))
        router = hf.endswith(".gate.weight")  # llama.cpp keeps it F32
        if quant is not None and array.ndim >= 2 and hf != "model.embed_tokens.weight" and not router:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name, array)
    for gguf_name, array in extra.items():
        w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
