"""The model's shape, read from a Hugging Face config.json.

One dataclass for the whole Llama family: the variants differ only in a few switches (q/k/v
bias for Qwen2, per-head q/k RMSNorm for Qwen3, fused q/k/v and gate/up tensors for Phi-3,
layers without rotation for SmolLM3, Gemma's scaled embedding, GeGLU, norms around each block
and soft-capping, sliding-window layers, rope scaling and partial rotation, tied embeddings,
and mixtures of experts in place of the MLP: Mixtral, Qwen3-MoE, OLMoE).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from model.errors import ModelError
from model.rope import KINDS, scaling_kind

# model_type -> (attention_bias default, q/k norm)
ARCHITECTURES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "phi3": (False, False),
    "smollm3": (False, False),
    "gemma2": (False, False),
    "gemma3_text": (False, True),
    "mixtral": (False, False),
    "qwen3_moe": (False, True),
    "olmoe": (False, True),
}
GEMMA = ("gemma2", "gemma3_text")
# Gemma3TextConfig's defaults: a Gemma 3 4B-27B config.json (Gemma3ForConditionalGeneration)
# gives its text_config only where they differ
GEMMA3_TEXT_DEFAULTS = {
    "model_type": "gemma3_text", "vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1}

# config.json's quantization_config.quant_method -> the name people know the format by; any
# quantization_config is refused (Spool reads float weights and quantizes them itself)
QUANT_METHODS = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8", "fbgemm_fp8": "FP8", "aqlm": "AQLM",
                 "hqq": "HQQ", "eetq": "EETQ", "mxfp4": "MXFP4"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None = None  # what the checkpoint was trained in: the GPU's default --dtype
    architectures: tuple[str, ...] = ()  # as config.json names them (what routers ask a worker)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate
    rope_layers: tuple[bool, ...] | None = None  # which layers rotate q and k; None: all
    layer_windows: tuple[int, ...] | None = None  # each layer's sliding window (0: all keys); None: none
    local_rope_theta: float | None = None  # Gemma 3's sliding layers: their own theta, unscaled
    query_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores = cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    gelu: bool = False  # GeGLU (tanh GELU) in place of SwiGLU
    num_experts: int = 0  # a mixture of experts' experts per layer; 0: a dense MLP
    experts_per_token: int = 0  # the top k a token is routed to
    expert_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights rescaled to sum to 1 (Mixtral always)
    moe_layers: tuple[bool, ...] | None = None  # which layers route to experts (the rest dense); None: all
    qk_norm_whole: bool = False  # OLMoE: q and k normalised over the whole projection, not per head

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        raw = text_model(raw)
        model_type = raw.get("model_type", "")
        if model_type not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise ModelError(
                f"unsupported architecture {model_type!r} (architectures: {raw.get('architectures')});"
                f" Spool runs the Llama family: {supported}"
            )
        bias_default, qk_norm = ARCHITECTURES[model_type]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            max_pos = int(raw.get("max_position_embeddings", 2048))
            theta, rope_scaling, partial, local_theta = _rope(raw, max_pos)
            layers = int(raw["num_hidden_layers"])
            gemma = model_type in GEMMA
            act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
            if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
                raise ModelError(f"unsupported activation {act!r} in config.json; Spool runs silu and"
                                 " gelu_pytorch_tanh")
            if raw.get("clip_qkv") is not None:
                raise ModelError(f"config.json sets clip_qkv ({raw['clip_qkv']}), which Spool does not"
                                 " implement; OLMoE's released checkpoints leave it null")
            experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", bias_default)),
                qk_norm=qk_norm,
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                architectures=tuple(raw.get("architectures") or ()),
                partial_rotary_factor=partial,
                rope_layers=_rope_layers(raw, model_type, layers),
                layer_windows=_windows(raw, model_type, layers),
                local_rope_theta=local_theta,
                query_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
                attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
                gelu=act != "silu",
                num_experts=experts,
                experts_per_token=int(raw["num_experts_per_tok"]) if experts else 0,
                expert_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
                if experts else 0,
                norm_topk_prob=model_type == "mixtral" or bool(raw.get("norm_topk_prob", False)),
                moe_layers=_moe_layers(raw, layers) if experts else None,
                qk_norm_whole=model_type == "olmoe",
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(
                f"config.json is malformed ({type(e).__name__}: {e});"
                " re-download or re-convert the model"
            ) from None

    @classmethod
    def load(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelError(
                f"model directory {model_dir} does not exist;"
                " pass --model with a Hugging Face model directory or a .gguf file"
            )
        if not path.is_file():
            raise ModelError(
                f"{model_dir} has no config.json, so it is not a Hugging Face model directory;"
                " pass --model with one, or with a .gguf file"
            )
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read {path} ({e}); re-download or re-convert the model") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{path} is not a JSON object; re-download or re-convert the model")
        config = cls.from_dict(raw)
        quantization = raw.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ModelError(
                f"{model_dir} holds {QUANT_METHODS.get(method, method or 'quantized')} weights"
                " (quantization_config in config.json), which Spool cannot load;"
                " use the original F16/BF16 checkpoint or a GGUF file"
            )
        return config

    @property
    def gemma(self) -> bool:
        """Gemma's shape: the embedding times sqrt(hidden), norms of (1 + weight), a norm after
        attention and after the MLP too."""
        return self.model_type in GEMMA

    @property
    def fused_tensors(self) -> bool:
        """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj."""
        return self.model_type == "phi3"

    @property
    def kv_window(self) -> int:
        """The positions back every layer attends to: the smallest window where every layer
        slides (Mistral's, Phi-3's), else 0 (some layer reads the whole context)."""
        windows = self.layer_windows or (0,)
        return 0 if not all(windows) else min(windows)

    def sparse(self, layer: int) -> bool:
        """Whether layer routes to experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(raw: dict, max_pos: int) -> tuple[float, dict | None, float, float | None]:
    """(theta, scaling or None, partial rotary factor, the sliding layers' theta or None) from
    either spelling: transformers 4's rope_theta, rope_scaling and Gemma 3's
    rope_local_base_freq, or 5's rope_parameters (per layer type for Gemma 3). A scaling comes
    back with its factor and original length filled in as transformers fills them."""
    params = raw.get("rope_parameters")
    local = raw.get("rope_local_base_freq") if raw.get("model_type") == "gemma3_text" else None
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        if set(params) != {"full_attention", "sliding_attention"} or \
                scaling_kind(params["sliding_attention"]) != "default":
            raise ModelError(f"config.json's rope_parameters per layer type ({', '.join(params)}) are not"
                             " the full/sliding pair of Gemma 3 with unscaled sliding layers")
        local, params = params["sliding_attention"].get("rope_theta", 10000.0), params["full_attention"]
    elif raw.get("model_type") == "gemma3_text":
        local = local or 10000.0
    scaling = dict(params or raw.get("rope_scaling") or {})
    default_theta = 1e6 if raw.get("model_type") == "gemma3_text" else 10000.0
    theta = float(scaling.pop("rope_theta", None) or raw.get("rope_theta") or default_theta)
    partial = float(scaling.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0)
    kind = scaling_kind(scaling)
    if kind not in KINDS:
        raise ModelError(f"unsupported rope scaling type {kind!r} in config.json;"
                         f" Spool supports {', '.join(KINDS)}")
    local = None if local is None else float(local)
    if kind == "default":
        return theta, None, partial, local
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    if kind in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the trained length beside rope_scaling, and it wins (as in transformers)
        original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or max_pos)
    if kind in ("yarn", "longrope") and not scaling.get("factor"):
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return theta, scaling, partial, local


def _windows(raw: dict, model_type: str, layers: int) -> tuple[int, ...] | None:
    """Each layer's sliding window, as transformers lays them out: Gemma's by layer_types (or
    every other layer for Gemma 2, five of six for Gemma 3), Qwen's from max_window_layers on
    when use_sliding_window says so, every layer for the rest (Mistral, Phi-3)."""
    window = int(raw.get("sliding_window") or 0)
    if not window or not raw.get("use_sliding_window", True):
        return None
    types = raw.get("layer_types")
    if types is None and model_type in GEMMA:
        pattern = 2 if model_type == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif types is None and model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif types is None:
        types = ["sliding_attention"] * layers
    if len(types) != layers:
        raise ModelError(f"config.json's layer_types has {len(types)} entries for {layers} layers")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else None


def _moe_layers(raw: dict, layers: int) -> tuple[bool, ...] | None:
    """Qwen3-MoE's dense layers: those in mlp_only_layers, and all but every decoder_sparse_step-th."""
    dense, step = set(raw.get("mlp_only_layers") or ()), int(raw.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return None if all(sparse) else sparse


def _rope_layers(raw: dict, model_type: str, layers: int) -> tuple[bool, ...] | None:
    """SmolLM3's no_rope_layers (1: the layer rotates), or every interval-th layer not rotating."""
    if model_type != "smollm3":
        return None
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ModelError(f"config.json's no_rope_layers has {len(flags)} entries for {layers} layers")
    rotates = tuple(bool(f) for f in flags)
    return None if all(rotates) else rotates


def text_model(raw: dict) -> dict:
    """A vision-language config's language model as a text model's config (Gemma 3 4B-27B:
    the vision tower is not served); any other config as it is."""
    if raw.get("model_type") != "gemma3" or not isinstance(raw.get("text_config"), dict):
        return raw
    outer = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "architectures") if k in raw}
    return {**GEMMA3_TEXT_DEFAULTS, **raw["text_config"], **outer, "model_type": "gemma3_text"}
