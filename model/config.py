"""The model's shape, read from a Hugging Face config.json.

One dataclass for the whole Llama family: the variants differ only in a few switches (q/k/v
bias, per-head q/k RMSNorm, fused tensors, layers without rotation, a scaled embedding, GeGLU,
norms around each block and soft-capping, sliding-window layers, rope scaling and partial
rotation, tied embeddings, and mixtures of experts in place of the MLP), each family's set by
its module in model/families/.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from model.errors import ModelError
from model.families import FAMILIES, Family
from model.families.family import DeltaNet
from model.quant.awq_gptq import checkpoint_format
from model.quant.fp8 import fp8_block
from model.rope import KINDS, scaling_kind

# config.json's quantization_config.quant_method -> the name people know the format by; any
# quantization_config but 4-bit AWQ and GPTQ (model/quant/awq_gptq.py) and FP8 (model/quant/fp8.py)
# is refused
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
    local_rope_theta: float | None = None  # sliding layers' own theta, unscaled (Family.local_rope)
    query_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores = cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # the same on the logits
    gelu: bool = False  # GeGLU (tanh GELU) in place of SwiGLU
    num_experts: int = 0  # a mixture of experts' experts per layer; 0: a dense MLP
    experts_per_token: int = 0  # the top k a token is routed to
    expert_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights rescaled to sum to 1
    moe_layers: tuple[bool, ...] | None = None  # which layers route to experts (the rest dense); None: all
    qk_norm_whole: bool = False  # q and k normalised over the whole projection, not per head
    shared_expert_size: int = 0  # a shared expert beside the routed ones (gated by a sigmoid): its width
    linear_layers: tuple[bool, ...] | None = None  # a hybrid model's gated delta-net layers; None: none
    delta_net: DeltaNet | None = None  # their shape
    attention_gate: bool = False  # the attention's output times a sigmoid of q_proj's gate half
    swiglu_clamp: tuple[float, float] | None = None  # experts' (alpha, limit): GPT-OSS's clamped SwiGLU
    attention_temperature: tuple[float, int] | None = None  # Llama 4's (beta, every n positions): queries
    # times 1 + beta * log(1 + floor(position / n)) (Ministral 3)
    layer_heads: tuple[tuple[int, int], ...] | None = None  # each layer's (kv heads, head_dim) where
    # layers differ (Gemma 4's full layers); None: (num_kv_heads, head_dim) everywhere
    kv_sources: tuple[int, ...] | None = None  # the layer whose K/V each layer reads (itself, or an earlier
    # one's: Gemma 4's last layers keep none); None: each its own
    value_norm: bool = False  # v RMS-normalised (without a weight) before it is cached
    layer_widths: tuple[int, ...] | None = None  # each layer's MLP width where they differ; None: intermediate_size
    per_layer_input: int = 0  # Gemma 4's per-layer embeddings: each layer's width of them (0: none)
    per_layer_vocab: int = 0  # ... and the rows of their table (0: vocab_size)
    experts_beside_mlp: bool = False  # the experts' output added to a dense MLP's (Gemma 4), not in its place

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        raw = text_model(raw)
        model_type = raw.get("model_type", "")
        family = FAMILIES.get(model_type)
        if family is None:
            supported = ", ".join(sorted(FAMILIES))
            raise ModelError(
                f"unsupported architecture {model_type!r} (architectures: {raw.get('architectures')});"
                f" Spool runs the Llama family: {supported}"
            )
        try:
            raw = family.raw_config(raw)
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            max_pos = int(raw.get("max_position_embeddings", 2048))
            theta, rope_scaling, partial, local_theta = _rope(raw, max_pos, family)
            layers = int(raw["num_hidden_layers"])
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
            fields = dict(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                # a model whose every layer routes (Qwen3.5-MoE) has no dense width: its shared expert's
                intermediate_size=int(raw.get("intermediate_size") or raw.get("shared_expert_intermediate_size")
                                      or raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", family.attention_bias)),
                qk_norm=family.qk_norm,
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                architectures=tuple(raw.get("architectures") or ()),
                partial_rotary_factor=partial,
                layer_windows=_windows(raw, family, layers),
                local_rope_theta=local_theta,
                attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
                gelu=act != "silu",
                num_experts=experts,
                experts_per_token=int(raw["num_experts_per_tok"]) if experts else 0,
                expert_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
                if experts else 0,
                norm_topk_prob=family.top_k_normalised or bool(raw.get("norm_topk_prob", False)),
                moe_layers=_moe_layers(raw, layers) if experts else None,
                shared_expert_size=int(raw.get("shared_expert_intermediate_size") or 0) if experts else 0,
                qk_norm_whole=family.qk_norm_whole,
            )
            return cls(**{**fields, **family.switches(raw, layers)})  # the family's own over the rest
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
        if quantization is not None and checkpoint_format(quantization, model_dir) is None \
                and fp8_block(quantization, model_dir) is False:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ModelError(
                f"{model_dir} holds {QUANT_METHODS.get(method, method or 'quantized')} weights"
                " (quantization_config in config.json), which Spool cannot load;"
                " use the original F16/BF16 checkpoint or a GGUF file"
            )
        return config

    @property
    def family(self) -> Family:
        """The family's names and switches (model/families/)."""
        return FAMILIES[self.model_type]

    @property
    def kv_window(self) -> int:
        """The positions back every layer attends to: the smallest window where every layer
        slides, else 0 (some layer reads the whole context)."""
        windows = self.layer_windows or (0,)
        return 0 if not all(windows) else min(windows)

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_heads[layer][0] if self.layer_heads else self.num_kv_heads

    def head_dim_of(self, layer: int) -> int:
        return self.layer_heads[layer][1] if self.layer_heads else self.head_dim

    def q_size_of(self, layer: int) -> int:
        return self.num_heads * self.head_dim_of(layer)

    def kv_size_of(self, layer: int) -> int:
        return self.kv_heads_of(layer) * self.head_dim_of(layer)

    def width_of(self, layer: int) -> int:
        """The layer's dense MLP width."""
        return self.layer_widths[layer] if self.layer_widths else self.intermediate_size

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V this layer attends to: itself unless it keeps none of its own."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def linear(self, layer: int) -> bool:
        """Whether layer is a gated delta net (linear attention: a state slot, no K/V)."""
        return self.linear_layers is not None and self.linear_layers[layer]

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep K/V (not a delta net, not reading another layer's)."""
        return [i for i in range(self.num_layers) if not self.linear(i) and self.kv_source(i) == i]

    def sparse(self, layer: int) -> bool:
        """Whether layer routes to experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def attention_break_even(self) -> int:
        """The cached positions at which a token's attention (q_size multiply-adds a position for
        its scores, as many for its output, a layer) is as much arithmetic as its projections
        and MLP (a mixture's routed experts only): past it, attention is most of a prompt token."""
        mlp = self.experts_per_token * self.expert_intermediate_size if self.num_experts else self.intermediate_size
        matrices = self.hidden_size * (2 * self.q_size + 2 * self.kv_size + 3 * mlp)
        return matrices // (2 * self.q_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(raw: dict, max_pos: int, family: Family) -> tuple[float, dict | None, float, float | None]:
    """(theta, scaling or None, partial rotary factor, the sliding layers' theta or None) from
    either spelling: transformers 4's rope_theta, rope_scaling and rope_local_base_freq (where
    the family's sliding layers rotate by their own), or 5's rope_parameters (per layer type
    there). A scaling comes back with its factor and original length filled in as transformers
    fills them."""
    params = raw.get("rope_parameters")
    local = raw.get("rope_local_base_freq") if family.local_rope else None
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        if set(params) != {"full_attention", "sliding_attention"} or \
                scaling_kind(params["sliding_attention"]) != "default":
            raise ModelError(f"config.json's rope_parameters per layer type ({', '.join(params)}) are not"
                             " a full/sliding pair with unscaled sliding layers")
        local, params = params["sliding_attention"].get("rope_theta", 10000.0), params["full_attention"]
    elif family.local_rope:
        local = local or 10000.0
    scaling = dict(params or raw.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", None) or raw.get("rope_theta") or family.default_rope_theta)
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


def _windows(raw: dict, family: Family, layers: int) -> tuple[int, ...] | None:
    """Each layer's sliding window, as transformers lays them out: by layer_types, else as the
    family lays them out (Family.layer_types), else on every layer; none where
    use_sliding_window says so."""
    window = int(raw.get("sliding_window") or 0)
    if not window or not raw.get("use_sliding_window", True):
        return None
    types = raw.get("layer_types")
    if types is None:
        types = family.layer_types(raw, layers) or ["sliding_attention"] * layers
    if len(types) != layers:
        raise ModelError(f"config.json's layer_types has {len(types)} entries for {layers} layers")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else None


def _moe_layers(raw: dict, layers: int) -> tuple[bool, ...] | None:
    """Which layers route to experts: every decoder_sparse_step-th but those in mlp_only_layers."""
    dense, step = set(raw.get("mlp_only_layers") or ()), int(raw.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return None if all(sparse) else sparse


def text_model(raw: dict) -> dict:
    """A vision-language config's language model as a text model's config (the family whose
    wrapper_type it is; the vision tower is not served); any other config as it is."""
    family = next((f for f in FAMILIES.values() if f.wrapper_type and f.wrapper_type == raw.get("model_type")), None)
    if family is None or not isinstance(raw.get("text_config"), dict):
        return raw
    outer = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "architectures") if k in raw}
    return {**family.text_defaults, **raw["text_config"], **outer, "model_type": family.model_type}
