"""Tiny random checkpoints of the families Spool runs, each in its real config.json's spelling
(rope scalings, fused tensors, partial rotation, layers without rotation), a few layers and
small widths. NumPy only: tests make them, and tools/family_fixtures.py feeds the same files to
transformers for the reference logits committed under tests/data/families/.
"""

import hashlib
import json
from pathlib import Path

import numpy as np

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 256, 64, 4, 2, 16, 128

_BASE = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
         "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
         "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 10000.0,
         "max_position_embeddings": 256, "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}


def _family(model_type: str, architecture: str, **changes) -> dict:
    return {**_BASE, "model_type": model_type, "architectures": [architecture], **changes}


def _factors(n: int, seed: int, low: float, high: float) -> list[float]:
    return [round(float(v), 4) for v in np.random.default_rng(seed).uniform(low, high, n)]


_GEMMA4 = dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
               rms_norm_eps=1e-6, sliding_window=6, global_head_dim=32, final_logit_softcapping=3.0, rope_theta=None,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 10000.0}})

# name -> (config.json, the context Spool serves it with: LongRoPE's factors depend on it)
FAMILIES = {
    "llama3-rope": (_family("llama", "LlamaForCausalLM", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), 256),
    "qwen2": (_family("qwen2", "Qwen2ForCausalLM", tie_word_embeddings=True, use_sliding_window=False), 256),
    # transformers 5's spelling: theta and scaling together in rope_parameters
    "qwen3-yarn": (_family("qwen3", "Qwen3ForCausalLM", rope_theta=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}), 256),
    "phi3-longrope-short": (_family("phi3", "Phi3ForCausalLM", original_max_position_embeddings=32, rope_scaling={
        "type": "longrope", "short_factor": _factors(8, 1, 1.0, 2.0), "long_factor": _factors(8, 2, 2.0, 8.0)},
        sliding_window=None), 32),
    "phi3-longrope-long": (_family("phi3", "Phi3ForCausalLM", original_max_position_embeddings=32, rope_scaling={
        "type": "longrope", "short_factor": _factors(8, 1, 1.0, 2.0), "long_factor": _factors(8, 2, 2.0, 8.0)},
        sliding_window=None), 256),
    # Phi-4-mini: a quarter of each head not rotated, tied embeddings
    "phi4-mini": (_family("phi3", "Phi3ForCausalLM", partial_rotary_factor=0.75, tie_word_embeddings=True,
                          sliding_window=None), 256),
    "smollm3": (_family("smollm3", "SmolLM3ForCausalLM", num_hidden_layers=4, tie_word_embeddings=True,
                        no_rope_layer_interval=2), 256),
    "smollm3-4": (_family("smollm3", "SmolLM3ForCausalLM", num_hidden_layers=4, tie_word_embeddings=True), 256),
    # caps and windows small enough to matter in 30 tokens of a tiny model
    "gemma2": (_family("gemma2", "Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh",
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6,
                       query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
                       final_logit_softcapping=3.0), 256),
    "gemma3": (_family("gemma3_text", "Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh",
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6,
                       num_hidden_layers=3, sliding_window_pattern=3, query_pre_attn_scalar=16,
                       sliding_window=6, rope_local_base_freq=100.0,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}), 256),
    # mixtures of experts: 64-wide experts, so that a block of 32 and a strip of 16 rows fit
    "mixtral": (_family("mixtral", "MixtralForCausalLM", intermediate_size=32, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=None), 256),
    # a dense layer beside a sparse one, and the top-k weights renormalised
    "qwen3-moe": (_family("qwen3_moe", "Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=3,
                          moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[1]), 256),
    # q/k norms over the whole projection, the top-k weights as the softmax gave them
    "olmoe": (_family("olmoe", "OlmoeForCausalLM", intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False), 256),
    # a hybrid: three gated delta nets, then full attention with an output gate and a quarter rotated
    "qwen3.5": (_family("qwen3_5_text", "Qwen3_5ForCausalLM", num_hidden_layers=4, rope_theta=None, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                        linear_num_value_heads=8), 256),
    # its mixture: every layer routes (softmax top 2 of 8, renormalised), beside a gated shared expert
    "qwen3.5-moe": (_family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", num_hidden_layers=4, rope_theta=None,
                            rms_norm_eps=1e-6, intermediate_size=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.25},
                            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                            linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=64), 256),
    # Ministral 3: YaRN and Llama 4's temperature from position 16 on (twice the released beta)
    "ministral3": (_family("ministral3", "Ministral3ForCausalLM", rope_theta=None, rope_parameters={
        "type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
        "llama_4_scaling_beta": 0.2}), 256),
    # sinks, a window of 6 on every other layer, YaRN, biased experts; a limit of 1.5 so that the
    # clamps bite on random weights (the released models' is 7)
    "gpt-oss": (_family("gpt_oss", "GptOssForCausalLM", rope_theta=None, intermediate_size=32,
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=6, attention_bias=True,
                        layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 64}), 256),
    # Gemma 4 E2B/E4B's shape: its own head size on full layers (rotated proportionally, a
    # quarter), the last two layers reading earlier layers' K/V with double-wide MLPs,
    # per-layer embeddings, a soft cap on the logits
    "gemma4": (_family("gemma4_text", "Gemma4ForCausalLM", **_GEMMA4, num_hidden_layers=5,
                       layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention",
                                                                "full_attention"],
                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
                       use_double_wide_mlp=True), 256),
    # its 26B-A4B's: full layers with one K/V head whose keys are its values, experts beside the MLP
    "gemma4-moe": (_family("gemma4_text", "Gemma4ForCausalLM", **_GEMMA4, num_hidden_layers=3,
                           layer_types=["sliding_attention"] * 2 + ["full_attention"], intermediate_size=64,
                           hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                           enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32), 256),
}


def moe_layers(config: dict) -> list[bool]:
    """Which layers hold experts (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)."""
    if "num_experts" not in config and "num_local_experts" not in config:
        return [False] * config["num_hidden_layers"]
    dense, step = set(config.get("mlp_only_layers", ())), config.get("decoder_sparse_step", 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, under Hugging Face's names."""
    c, kind = config, config["model_type"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, i = c["hidden_size"], c["intermediate_size"]
    experts = c.get("num_experts") or c.get("num_local_experts")
    expert_i = c.get("moe_intermediate_size") or i
    sparse = moe_layers(c)
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{n}.", f"model.layers.{n}.self_attn."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind.startswith("qwen3_5"):
            if kind == "qwen3_5_moe_text":
                e, s = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
                shapes[p + "mlp.gate.weight"] = (c["num_experts"], h)
                for x in range(c["num_experts"]):
                    shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": (e, h),
                                   f"{p}mlp.experts.{x}.up_proj.weight": (e, h),
                                   f"{p}mlp.experts.{x}.down_proj.weight": (h, e)})
                shapes.update({p + "mlp.shared_expert.gate_proj.weight": (s, h),
                               p + "mlp.shared_expert.up_proj.weight": (s, h),
                               p + "mlp.shared_expert.down_proj.weight": (h, s),
                               p + "mlp.shared_expert_gate.weight": (1, h)})
            else:
                shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                               p + "mlp.down_proj.weight": (h, i)})
            if c["layer_types"][n] == "linear_attention":
                shapes.update(delta_net_shapes(c, f"model.layers.{n}.linear_attn."))
            else:  # q_proj: each head's query rows, then its gate's
                shapes.update({a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h),
                               a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q),
                               a + "q_norm.weight": (c["head_dim"],), a + "k_norm.weight": (c["head_dim"],)})
            continue
        if kind == "gpt_oss":
            shapes.update(gpt_oss_shapes(c, p))
            continue
        if kind == "gemma4_text":
            shapes.update(gemma4_shapes(c, n))
            continue
        if kind.startswith("gemma"):
            shapes[p + "pre_feedforward_layernorm.weight"] = shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if kind == "phi3":
            shapes[a + "qkv_proj.weight"] = (q + 2 * kv, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            shapes.update({a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h)})
            if not sparse[n]:
                shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)})
        shapes[a + "o_proj.weight"] = (h, q)
        if not sparse[n]:
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        else:  # the Hub's spelling; Mixtral's w1 gate, w3 up, w2 down
            m, (gate, up, down) = ((p + "block_sparse_moe.", ("w1", "w3", "w2")) if kind == "mixtral" else
                                   (p + "mlp.", ("gate_proj", "up_proj", "down_proj")))
            shapes[m + "gate.weight"] = (experts, h)
            for e in range(experts):
                shapes.update({f"{m}experts.{e}.{gate}.weight": (expert_i, h),
                               f"{m}experts.{e}.{up}.weight": (expert_i, h),
                               f"{m}experts.{e}.{down}.weight": (h, expert_i)})
        if kind == "qwen2":
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
            shapes[a + "q_norm.weight"] = shapes[a + "k_norm.weight"] = (c["head_dim"],)
        if kind == "olmoe":  # over the whole projection, not per head
            shapes[a + "q_norm.weight"], shapes[a + "k_norm.weight"] = (q,), (kv,)
    if c.get("hidden_size_per_layer_input"):  # Gemma 4's per-layer embeddings
        ple = c["num_hidden_layers"] * c["hidden_size_per_layer_input"]
        shapes.update({"model.embed_tokens_per_layer.weight": (c["vocab_size_per_layer_input"], ple),
                       "model.per_layer_model_projection.weight": (ple, h),
                       "model.per_layer_projection_norm.weight": (c["hidden_size_per_layer_input"],)})
    return shapes


def gemma4_shapes(c: dict, n: int) -> dict[str, tuple[int, ...]]:
    """A Gemma 4 layer's tensors: a full layer's own head size (and K/V heads where its keys are
    its values), no K/V projections in the last num_kv_shared_layers (their MLPs double-wide where
    use_double_wide_mlp), per-layer input tensors, experts beside the MLP."""
    p, a, h = f"model.layers.{n}.", f"model.layers.{n}.self_attn.", c["hidden_size"]
    full = c["layer_types"][n] == "full_attention"
    d = c["global_head_dim"] if full else c["head_dim"]
    keys_are_values = full and c.get("attention_k_eq_v", False)
    kv = (c["num_global_key_value_heads"] if keys_are_values else c["num_key_value_heads"]) * d
    shared = n >= c["num_hidden_layers"] - c.get("num_kv_shared_layers", 0)
    i = c["intermediate_size"] * (2 if shared and c.get("use_double_wide_mlp") else 1)
    q = c["num_attention_heads"] * d
    shapes = {a + "q_proj.weight": (q, h), a + "q_norm.weight": (d,), a + "o_proj.weight": (h, q),
              p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
              p + "layer_scalar": (1,)}
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        shapes[p + norm + ".weight"] = (h,)
    if not shared:
        shapes.update({a + "k_proj.weight": (kv, h), a + "k_norm.weight": (d,)})
        if not keys_are_values:
            shapes[a + "v_proj.weight"] = (kv, h)
    if c.get("hidden_size_per_layer_input"):
        ple = c["hidden_size_per_layer_input"]
        shapes.update({p + "per_layer_input_gate.weight": (ple, h), p + "per_layer_projection.weight": (h, ple),
                       p + "post_per_layer_input_norm.weight": (h,)})
    if c.get("enable_moe_block"):
        e, m = c["num_experts"], c["moe_intermediate_size"]
        shapes.update({p + "router.scale": (h,), p + "router.per_expert_scale": (e,), p + "router.proj.weight": (e, h),
                       p + "experts.gate_up_proj": (e, 2 * m, h), p + "experts.down_proj": (e, h, m)})
        for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            shapes[p + norm + ".weight"] = (h,)
    return shapes


def gpt_oss_shapes(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    """A GPT-OSS layer's attention (biased, with sinks) and stacked experts, under prefix p."""
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, i, e, a = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], p + "self_attn."
    return {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q), a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
            a + "o_proj.bias": (h,), a + "sinks": (c["num_attention_heads"],),
            p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
            p + "mlp.experts.gate_up_proj": (e, h, 2 * i), p + "mlp.experts.gate_up_proj_bias": (e, 2 * i),
            p + "mlp.experts.down_proj": (e, i, h), p + "mlp.experts.down_proj_bias": (e, h)}


def delta_net_shapes(c: dict, d: str) -> dict[str, tuple[int, ...]]:
    """A gated delta-net layer's tensors (Qwen3.5's linear_attn), under prefix d."""
    keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    values, heads = c["linear_num_value_heads"] * c["linear_value_head_dim"], c["linear_num_value_heads"]
    h = c["hidden_size"]
    return {d + "in_proj_qkv.weight": (2 * keys + values, h), d + "in_proj_z.weight": (values, h),
            d + "in_proj_b.weight": (heads, h), d + "in_proj_a.weight": (heads, h),
            d + "conv1d.weight": (2 * keys + values, 1, c["linear_conv_kernel_dim"]), d + "dt_bias": (heads,),
            d + "A_log": (heads,), d + "norm.weight": (c["linear_value_head_dim"],), d + "out_proj.weight": (h, values)}


def random_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 tensors scaled so that logits are neither flat nor one-hot."""
    rng = np.random.default_rng(seed)
    # Gemma and Qwen3.5 store w of 1 + w (but for Qwen3.5's gated delta-net norms)
    unit = 0.0 if config["model_type"].startswith(("gemma2", "gemma3", "qwen3_5")) else 1.0
    out = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("A_log"):  # decays of 0.6-0.95 a token: a memory of a few dozen tokens
            t = np.log(rng.uniform(0.05, 0.5, shape))
        elif name.endswith("dt_bias"):
            t = 0.5 * rng.standard_normal(shape)
        elif name.endswith("conv1d.weight"):
            t = 0.5 * rng.standard_normal(shape)
        elif name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight")):
            t = unit + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("layer_scalar", "router.per_expert_scale")):
            t = rng.uniform(0.5, 1.5, shape)
        elif name.endswith("router.scale"):
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and config["model_type"] == "gemma4_text":
            t = rng.standard_normal(shape) / np.sqrt(shape[2])
        elif name == "model.embed_tokens_per_layer.weight":
            t = rng.standard_normal(shape)
        elif name.endswith(("bias", "sinks")):
            t = 0.5 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":  # tied: small, or each token predicts itself
            t = (0.15 if config["tie_word_embeddings"] else 0.5) * rng.standard_normal(shape)
            if config["model_type"].startswith("gemma"):
                t /= np.sqrt(shape[1])  # Gemma multiplies it by sqrt(hidden)
        else:
            t = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = t.astype(np.float32)
    return out


def mtp_tensors(config: dict, seed: int = 1) -> dict[str, np.ndarray]:
    """A Qwen3.5 checkpoint's multi-token-prediction layer (mtp.*, vLLM's names), random: a
    full-attention layer after the model's, its fc over the normalised embedding and hidden
    state side by side, and the norms around it."""
    n, h = config["num_hidden_layers"], config["hidden_size"]
    longer = {**config, "num_hidden_layers": n + 1, "layer_types": [*config["layer_types"], "full_attention"]}
    layer = f"model.layers.{n}."
    shapes = {"mtp.layers.0." + k[len(layer):]: v for k, v in tensor_shapes(longer).items() if k.startswith(layer)}
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    rng = np.random.default_rng(seed)
    return {name: (0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")  # of 1 + w
                   else rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            for name, shape in shapes.items()}


def digest(tensors: dict[str, np.ndarray]) -> str:
    """Names and bytes of every tensor: what a fixture was made from."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()[:16]


def make_family(name: str, path: Path) -> tuple[Path, str]:
    """The checkpoint of family `name` in directory path: (path, the tensors' digest)."""
    return write_checkpoint(FAMILIES[name][0], path)


def write_checkpoint(config: dict, path: Path) -> tuple[Path, str]:
    """A random checkpoint of config.json `config` in directory path: (path, the tensors' digest)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = random_tensors(config)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=1))
    save_file(tensors, str(path / "model.safetensors"))
    return path, digest(tensors)
