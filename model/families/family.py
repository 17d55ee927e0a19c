"""What sets one architecture apart from Llama's: its names (Hugging Face's and GGUF's), the
tensors it keeps elsewhere, the switches it sets for the forward pass, and what it reads
differently from a config.json or a GGUF's metadata.

A family is a subclass that overrides what differs; the defaults are Llama's. Everything else
(model/config.py, model/weights.py, model/gguf/) reads a family through these attributes and
hooks, never by its name, so that a new family is one new module in this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures entry (what converting a GGUF writes)
    gguf_arch: str | None = None  # a GGUF's general.architecture; None: no GGUF of it is read

    # attention
    attention_bias: bool = False  # q/k/v biases where config.json does not say (a GGUF must have them)
    qk_norm: bool = False  # q and k RMS-normalised before the rotation
    qk_norm_whole: bool = False  # ... over the whole projection, not per head
    qkv: str | None = None  # q, k and v stored as one tensor under this per-layer name
    keys_as_values: bool = False  # a layer without v_proj uses k_proj's output as its values too
    attention_sinks: bool = False  # a learned logit per query head beside the scores (self_attn.sinks)

    # the MLP, or a mixture of experts in its place
    gate_up: str | None = None  # gate and up stored as one tensor under this per-layer name
    moe: bool = False  # routes to experts (a GGUF with experts of another family is refused)
    experts_key: str = "num_experts"  # config.json's key for the experts per layer
    expert_prefix: str = "mlp."  # a layer's router and experts, under model.layers.N.
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up, down
    router: str = "gate"  # the router's name under the expert prefix (its .bias read where there is one)
    top_k_normalised: bool | None = None  # the top-k routing weights always rescaled; None: norm_topk_prob
    gguf_top_k_normalised: bool = False  # llama.cpp's default where a GGUF has no expert_weights_norm

    # norms and the embedding
    mlp_norm: str = "post_attention_layernorm.weight"  # the norm before the MLP, per layer
    post_norms: tuple[str, str] | None = None  # norms of the attention's and the MLP's outputs too
    unit_offset_norms: bool = False  # a checkpoint's norm holds w for a scale of 1 + w (a GGUF's 1 + w)
    scaled_embedding: bool = False  # the embedding times sqrt(hidden)

    # rotation and windows
    default_rope_theta: float = 10000.0  # where config.json gives none
    local_rope: bool = False  # sliding layers rotate by their own theta (rope_local_base_freq)
    gguf_rope_order: bool = False  # llama.cpp stores q/k rows in its rope order (so: all dims rotate)
    gguf_sliding_window: bool = False  # a GGUF's sliding window is read by gguf_switches (or ignored)
    gguf_yarn_truncate: bool = True  # a GGUF's YaRN correction range rounded to whole dims (llama.cpp's)

    # hybrid models: the full-attention layers' output gated (q_proj holds a gate beside each head)
    attention_gate: bool = False
    gguf_names: dict | None = None  # GGUF per-layer suffixes of its own -> Hugging Face per-layer names
    gguf_globals: dict | None = None  # GGUF tensors of its own outside the layers -> Hugging Face names

    # a vision-language model whose language model this family serves
    wrapper_type: str | None = None  # its config.json's model_type
    text_defaults: dict | None = None  # its text_config's defaults, given only where they differ

    def raw_config(self, raw: dict) -> dict:
        """config.json under the keys the common fields are read by (a family that names them
        otherwise renames them here)."""
        return raw

    def layer_extras(self, reader, layer: int) -> dict:
        """LayerWeights fields only this family reads, through reader (weights.LayerReader)."""
        return {}

    def outer_extras(self, reader, prepare) -> dict:
        """Weights fields beside the layers only this family reads, prepared."""
        return {}

    def switches(self, raw: dict, layers: int) -> dict:
        """ModelConfig fields only this family reads from config.json (raw)."""
        return {}

    def layer_types(self, raw: dict, layers: int) -> list[str] | None:
        """Each layer's attention ("sliding_attention" or "full_attention") where config.json has
        a sliding_window but no layer_types; None: every layer slides."""
        return None

    def gguf_switches(self, field: Callable, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        """ModelConfig fields only this family reads (or infers, as llama.cpp does) from a GGUF's
        metadata; field(key, default=None) reads one key."""
        return {}

    def gguf_shapes(self, switches: dict, hidden: int, layers: int, vocab: int, experts: int = 0) -> dict:
        """Hugging Face shapes of the GGUF tensors of its own (gguf_names' per-layer names, the
        same in every layer; gguf_globals' full names), from its gguf_switches."""
        return {}

    def gguf_mixers(self, field, layers: int) -> tuple[bool, ...] | None:
        """Which layers of a GGUF are delta nets (linear attention); None: none."""
        return None

    def stacked_experts(self, read: Callable, layer: int, experts: int, hidden: int, inner: int) -> dict | None:
        """Experts fields from a checkpoint that stacks a layer's experts in one tensor per
        projection; None (or fields without gate_up): they are read per expert (expert_tensors)."""
        return None

    def hf_fields(self, c) -> dict:
        """What config.json says for this family beyond the common fields, as transformers
        writes it (converting a GGUF); c: the ModelConfig read from the GGUF."""
        return {}

    def expert_tensors(self, layer: int) -> tuple[str, dict[str, str]]:
        """Where a checkpoint keeps layer's router (prefix + "gate.weight") and expert e's matrices
        (prefix + f"experts.{e}.{names[part]}.weight" for part gate, up, down)."""
        return f"model.layers.{layer}.{self.expert_prefix}", dict(zip(("gate", "up", "down"), self.expert_names))


def every_nth_full(layers: int, n: int) -> list[str]:
    """Layer types where every n-th layer attends to the whole context and the rest slide."""
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]


@dataclass(frozen=True)
class DeltaNet:
    """The shape of a hybrid model's gated delta-net layers (linear attention, as Qwen3.5 has
    them): per request each keeps a (key_dim, value_dim) state per value head and the last
    conv_kernel - 1 inputs of its short convolution, in place of K/V."""

    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int
    conv_kernel: int
    tiled: bool = False  # value head j reads key head j % key_heads (a GGUF's order), not j // (value/key heads)

    @property
    def keys(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:
        """q, k and v go through the convolution together."""
        return 2 * self.keys + self.values

    @property
    def projections(self) -> int:
        """Rows of the fused input projection: q, k, v, the output gate z, then b and a per value head."""
        return self.conv_channels + self.values + 2 * self.value_heads

    @property
    def state_floats(self) -> int:
        """One request's state in one layer: the recurrent matrices and the convolution's history."""
        return self.value_heads * self.key_dim * self.value_dim + (self.conv_kernel - 1) * self.conv_channels
