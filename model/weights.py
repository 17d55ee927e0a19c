"""Weights from memory-mapped safetensors files (model/safetensors_files.py), or from a GGUF file
in place (model/gguf/tensors.py), under the names the model's family gives them
(model/families/), fused the way the forward pass wants and prepared for the ops (packed, or
copied to a device) one layer at a time.

No float32 copy of the whole model ever exists: a tensor is converted only when taken. A GGUF's
quantized tensors go to the ops as their blocks (model/quant/quantized.py), never as float32
unless the ops want that.
"""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from model.config import ModelConfig
from model.errors import ModelError
from model.quant import awq_gptq, fp8
from model.quant.quantized import float32, fuse, take_rows
from model.rope import rotary_dim, rotary_row_order
from model.safetensors_files import ModelTensors

GGUF_NAME = "model.gguf"  # in a model directory: the GGUF its weights are read from, in place


def open_tensors(model_dir: Path):
    """The directory's tensors: its model.gguf (the file itself, or a link to it) where it has
    one, else its safetensors files (an AWQ or GPTQ checkpoint's int4 layers as blocks, an FP8
    one's weights as float32)."""
    gguf_file = Path(model_dir) / GGUF_NAME
    if gguf_file.is_symlink() and not gguf_file.exists():
        raise ModelError(
            f"{gguf_file} links to {gguf_file.readlink()}, which no longer exists; Spool reads a GGUF's weights"
            " in place: pass --model with the .gguf file again"
        )
    if gguf_file.exists():
        from model.gguf.tensors import GGUFTensors

        return GGUFTensors(gguf_file.resolve())  # errors name the file the user gave
    quantization = awq_gptq.quantization_config(model_dir)
    if (int4 := awq_gptq.checkpoint_format(quantization, model_dir)) is not None:
        return awq_gptq.Int4Tensors(model_dir, int4)
    if (block := fp8.fp8_block(quantization, model_dir)) is not False:
        return fp8.FP8Tensors(model_dir, block)
    return ModelTensors(model_dir)


def read_model_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32 at once: for references in tests, never for serving."""
    with open_tensors(model_dir) as tensors:
        return {name: float32(tensors.read(name)) for name in tensors.entries}


@dataclass
class Experts:
    """A mixture of experts in place of the MLP: the router, and every expert's gate/up and down
    stacked along their rows (expert e's gate then up rows from e x 2 x intermediate, its down
    rows from e x hidden), so that a backend multiplies the rows routed to an expert as one GEMM
    and every expert's as one grouped call."""

    router: np.ndarray  # (experts, hidden), float32 on every backend as llama.cpp keeps it
    gate_up: np.ndarray  # (experts x 2 x intermediate, hidden)
    down: np.ndarray  # (experts x hidden, intermediate)
    top_k: int
    normalize: bool  # the top k's weights rescaled to sum to 1
    # a shared expert every token goes through, its output times sigmoid(x . shared_gate) (Qwen3.5-MoE)
    shared_gate_up: np.ndarray | None = None  # (2 x shared intermediate, hidden)
    shared_down: np.ndarray | None = None  # (hidden, shared intermediate)
    shared_gate: np.ndarray | None = None  # (1, hidden), float32 as the router
    # GPT-OSS's: biases on the router's logits and on every expert's outputs (float32, stacked as
    # the rows), and the clamped SwiGLU's (alpha, limit) in place of SiLU-and-mul
    router_bias: np.ndarray | None = None  # (experts,)
    gate_up_bias: np.ndarray | None = None  # (experts x 2 x intermediate,)
    down_bias: np.ndarray | None = None  # (experts x hidden,)
    swiglu_clamp: tuple[float, float] | None = None
    expert_scale: np.ndarray | None = None  # (experts,) float32: each expert's output times its own (Gemma 4)

    @property
    def count(self) -> int:
        return self.router.shape[0]

    @property
    def floats(self) -> tuple:
        """The small float32 tensors beside the matrices: the router's, a shared gate, biases."""
        return self.router, self.shared_gate, self.router_bias, self.gate_up_bias, self.down_bias, self.expert_scale

    @property
    def nbytes(self) -> int:
        arrays = (self.gate_up, self.down, self.shared_gate_up, self.shared_down, *self.floats)
        return sum(a.nbytes for a in arrays if a is not None)

    def prepared(self, prepare: Callable, keep_float: Callable) -> "Experts":
        """The experts' matrices through prepare (ops.weight), the router (and a shared expert's
        gate) through keep_float (ops.asarray): routing on rounded weights would choose other
        experts than the checkpoint's."""
        shared = {} if self.shared_gate is None else dict(
            shared_gate_up=prepare(self.shared_gate_up), shared_down=prepare(self.shared_down))
        floats = {k: keep_float(float32(getattr(self, k))) for k in
                  ("router", "shared_gate", "router_bias", "gate_up_bias", "down_bias", "expert_scale")
                  if getattr(self, k) is not None}
        return replace(self, gate_up=prepare(self.gate_up), down=prepare(self.down), **shared, **floats)


@dataclass
class DeltaNetWeights:
    """A gated delta-net layer (model/ops/delta_rule.py): its input projections as one GEMM, and
    the small float32 tensors its recurrence reads."""

    in_proj: np.ndarray  # (DeltaNet.projections, hidden): q, k, v, then z, b and a
    conv: np.ndarray  # (conv_channels, kernel), oldest tap first
    dt_bias: np.ndarray  # (value_heads,)
    decay: np.ndarray  # (value_heads,): -exp(A_log), each head's decay per unit of softplus(a + dt_bias)
    norm: np.ndarray  # (value_dim,): the gated output norm's weight (w itself, never 1 + w)
    out_proj: np.ndarray  # (hidden, values)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values())

    def prepared(self, prepare: Callable, keep_float: Callable) -> "DeltaNetWeights":
        """The two projections through prepare (ops.weight), the rest through keep_float."""
        return DeltaNetWeights(prepare(self.in_proj), *(keep_float(float32(v)) for v in
                                                       (self.conv, self.dt_bias, self.decay, self.norm)),
                               prepare(self.out_proj))


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (hidden,)
    wqkv: np.ndarray | None  # (q + 2 kv, hidden): q, k and v projections in one GEMM (q, its gate, k and v
    # where the family gates the output); None in a delta-net layer
    bqkv: np.ndarray | None  # (q + 2 kv,) where the family has q/k/v biases
    q_norm: np.ndarray | None  # (head_dim,) with q/k norms; (q,) over the whole projection
    k_norm: np.ndarray | None
    wo: np.ndarray | None  # (hidden, q)
    mlp_norm: np.ndarray
    w_gate_up: np.ndarray | None  # (2 * intermediate, hidden): gate and up in one GEMM; None with experts
    w_down: np.ndarray | None  # (hidden, intermediate)
    post_attn_norm: np.ndarray | None = None  # the attention's output normalised before the residual add
    post_mlp_norm: np.ndarray | None = None  # the same for the MLP's
    experts: Experts | None = None  # a mixture of experts' layer: in place of w_gate_up and w_down
    delta_net: DeltaNetWeights | None = None  # a hybrid model's linear-attention layer: in place of attention
    bo: np.ndarray | None = None  # (hidden,): the output projection's bias, where the checkpoint has one
    sinks: np.ndarray | None = None  # (heads,): each query head's sink logit (Family.attention_sinks)
    v_norm: np.ndarray | None = None  # (head_dim,) ones: v RMS-normalised (ModelConfig.value_norm)
    # Gemma 4's (model/families/gemma4.py): its per-layer embeddings' use, and the norms around
    # experts beside the dense MLP (ModelConfig.experts_beside_mlp)
    per_layer: object | None = None  # PerLayerInput
    expert_norms: object | None = None  # ExpertNorms
    scalar: float | None = None  # the stream times this at the layer's end (Gemma 4's layer_scalar)


@dataclass
class Weights:
    embed: np.ndarray  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: np.ndarray  # (vocab, hidden); the embedding itself when tied
    per_layer: object | None = None  # Gemma 4's per-layer embeddings (families/gemma4.PerLayerEmbedding)


def prepared(layer: LayerWeights, prepare: Callable, keep_float: Callable = float32) -> LayerWeights:
    """A layer as read (float32 arrays, a GGUF's blocks) as the ops keep it (ops.weight on each;
    a router and the sinks through keep_float, ops.asarray: Experts.prepared)."""
    return replace(layer, **{k: v.prepared(prepare, keep_float) if hasattr(v, "prepared")
                             else keep_float(v) if k == "sinks" else prepare(v)
                             for k, v in vars(layer).items() if v is not None and k != "scalar"})


def load_weights(model_dir: Path, config: ModelConfig, prepare: Callable = float32,
                 progress: bool | None = None, keep_float: Callable = float32) -> Weights:
    """The model's weights through prepare (ops.weight; float32 arrays by default), one layer's
    tensors at a time; routers through keep_float (ops.asarray).
    progress: a bar on stderr; None shows it only when stderr is a terminal."""
    from tqdm import tqdm

    with open_tensors(model_dir) as tensors:
        bar = tqdm(total=config.num_layers + 1, desc=f"Loading {Path(model_dir).name}", unit="layer",
                   disable=None if progress is None else not progress, leave=False)
        reader = LayerReader(tensors, model_dir, config)
        layers = []
        for i in range(config.num_layers):
            layers.append(prepared(reader.layer(i), prepare, keep_float))
            bar.update()
        embed, norm, lm_head = reader.outer(prepare)
        extras = config.family.outer_extras(reader, prepare)
        bar.update()
        bar.close()
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head, **extras)


def qkv_rows(c: ModelConfig, i: int) -> np.ndarray | None:
    """Where layer i's fused q/k/v rows come from, or None where they stay as read. A partial
    rotation: each q/k head's rotated pairs moved to where the kernels rotate (model/rope.py);
    v's rows stay. A gate: every head's query rows, then every head's gate rows, each row kept
    within its tensor (a packed Fused's parts, a LoRA module's rows: model/lora.py)."""
    D = c.head_dim_of(i)
    order = rotary_row_order(D, rotary_dim(c, D))
    if order is None and not c.attention_gate:
        return None
    Q, KV = c.q_size_of(i), c.kv_size_of(i)
    q_rows = 2 * Q if c.attention_gate else Q
    within = np.arange(D) if order is None else order
    stride = 2 * D if c.attention_gate else D
    heads = [(np.arange(c.num_heads)[:, None] * stride + within).ravel()]
    if c.attention_gate:
        heads.append((np.arange(c.num_heads)[:, None] * stride + D + np.arange(D)).ravel())
    heads += [(np.arange(c.kv_heads_of(i))[:, None] * D + within).ravel() + q_rows, q_rows + KV + np.arange(KV)]
    return np.concatenate(heads)


class LayerReader:
    """Reads a layer's tensors, checked against config.json's shapes, fused into their GEMMs."""

    def __init__(self, tensors, model_dir: Path, config: ModelConfig):  # ModelTensors or GGUFTensors
        self.tensors, self.model_dir, self.config = tensors, model_dir, config

    def check(self, name: str, shape: tuple) -> None:
        if name not in self.tensors.entries:
            raise ModelError(
                f"tensor {name} is missing from {self.model_dir}; the checkpoint does not match its"
                " config.json: re-download or re-convert it"
            )
        if self.tensors.entries[name].shape != shape:
            raise ModelError(
                f"tensor {name} has shape {self.tensors.entries[name].shape}, config.json implies {shape};"
                " re-download or re-convert the model"
            )

    def take(self, name: str, shape: tuple) -> np.ndarray:
        self.check(name, shape)
        return self.tensors.read(name)

    def norm(self, name: str, shape: tuple) -> np.ndarray:
        """An RMSNorm's weight as the ops multiply by it: some families' checkpoints store w for a
        scale of 1 + w (llama.cpp's GGUFs store 1 + w already)."""
        w = self.take(name, shape)
        return w + np.float32(1.0) if self.config.family.unit_offset_norms and not self.tensors.norms_include_one else w

    def fused(self, parts: list[tuple[str, tuple]]):
        """The parts stacked along their first axis, each read straight into its rows; where any
        is quantized, their blocks stacked, or a Fused of parts of different kinds (quantized.fuse)."""
        for name, shape in parts:
            self.check(name, shape)
        if any(self.tensors.quantized(name) for name, _ in parts):
            return fuse([self.tensors.read(name) for name, _ in parts])
        out = np.empty((sum(shape[0] for _, shape in parts), *parts[0][1][1:]), dtype=np.float32)
        row = 0
        for name, shape in parts:
            self.tensors.read_into(name, out[row:row + shape[0]])
            row += shape[0]
        return out

    def layer(self, i: int) -> LayerWeights:
        c, f = self.config, self.config.family
        H, I = c.hidden_size, c.width_of(i)
        p = f"model.layers.{i}."
        experts, w_gate_up, w_down = None, None, None
        if c.sparse(i):
            experts = self.experts(i)
        if not c.sparse(i) or c.experts_beside_mlp:
            if f.gate_up:
                w_gate_up = self.take(p + f.gate_up, (2 * I, H))
            else:
                w_gate_up = self.fused([(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H))])
            w_down = self.take(p + "mlp.down_proj.weight", (H, I))
        mixer = dict(delta_net=self.delta_net(i)) if c.linear(i) else self.attention(i)
        layer = LayerWeights(**{"wqkv": None, "bqkv": None, "q_norm": None, "k_norm": None, "wo": None, **mixer},
                             attn_norm=self.norm(p + "input_layernorm.weight", (H,)),
                             mlp_norm=self.norm(p + f.mlp_norm, (H,)), w_gate_up=w_gate_up, w_down=w_down,
                             experts=experts, **f.layer_extras(self, i))
        if f.post_norms:
            layer.post_attn_norm = self.norm(p + f.post_norms[0], (H,))
            layer.post_mlp_norm = self.norm(p + f.post_norms[1], (H,))
        return layer

    def attention(self, i: int) -> dict:
        """Layer i's attention tensors, as LayerWeights fields: q/k/v fused (and q_proj's gate
        after them, where the family gates the output), its biases, q/k norms, output."""
        c, f = self.config, self.config.family
        H, Q, KV, D = c.hidden_size, c.q_size_of(i), c.kv_size_of(i), c.head_dim_of(i)
        a = f"model.layers.{i}.self_attn."
        q_rows = 2 * Q if c.attention_gate else Q  # a gate after each head's query rows
        if c.kv_source(i) != i:  # it reads an earlier layer's K/V: a query and its norm only
            return dict(wqkv=self.take(a + "q_proj.weight", (Q, H)), bqkv=None, k_norm=None,
                        q_norm=self.norm(a + "q_norm.weight", (D,)), wo=self.take(a + "o_proj.weight", (H, Q)))
        bias = None
        if c.attention_bias:
            bias = self.fused([(a + "q_proj.bias", (q_rows,)), (a + "k_proj.bias", (KV,)),
                               (a + "v_proj.bias", (KV,))])
        # without v_proj, a family whose keys may be its values (Gemma 4's full layers) reads k_proj twice
        values = a + ("v_proj.weight" if a + "v_proj.weight" in self.tensors.entries or not f.keys_as_values
                      else "k_proj.weight")
        if f.qkv:
            wqkv = self.take(f"model.layers.{i}.{f.qkv}", (Q + 2 * KV, H))
        else:
            wqkv = self.fused([(a + "q_proj.weight", (q_rows, H)), (a + "k_proj.weight", (KV, H)), (values, (KV, H))])
        norm = (Q, KV) if c.qk_norm_whole else (D, D)
        q_norm = self.norm(a + "q_norm.weight", (norm[0],)) if c.qk_norm else None
        k_norm = self.norm(a + "k_norm.weight", (norm[1],)) if c.qk_norm else None
        order = rotary_row_order(D, rotary_dim(c, D))
        out = dict(wo=self.take(a + "o_proj.weight", (H, Q)))
        if c.value_norm:
            out["v_norm"] = np.ones(D, np.float32)
        if a + "o_proj.bias" in self.tensors.entries:
            out["bo"] = float32(self.take(a + "o_proj.bias", (H,)))
        if f.attention_sinks:
            out["sinks"] = float32(self.take(a + "sinks", (c.num_heads,)))
        rows = qkv_rows(c, i)
        if rows is None:
            return dict(wqkv=wqkv, bqkv=bias, q_norm=q_norm, k_norm=k_norm, **out)
        return dict(wqkv=take_rows(wqkv, rows), bqkv=None if bias is None else take_rows(bias, rows),
                    q_norm=q_norm if q_norm is None or order is None else q_norm[order],
                    k_norm=k_norm if k_norm is None or order is None else k_norm[order], **out)

    def delta_net(self, i: int) -> DeltaNetWeights:
        """Layer i's gated delta net: q/k/v, z, b and a projections fused into one GEMM."""
        c, shape = self.config, self.config.delta_net
        H, heads = c.hidden_size, shape.value_heads
        d = f"model.layers.{i}.linear_attn."
        channels, kernel = shape.conv_channels, shape.conv_kernel
        conv = self.tensors.entries.get(d + "conv1d.weight")  # a checkpoint's (channels, 1, kernel), a GGUF's 2-D
        conv_shape = (channels, 1, kernel) if conv is not None and len(conv.shape) == 3 else (channels, kernel)
        if d + "A_log" in self.tensors.entries:
            decay = -np.exp(float32(self.take(d + "A_log", (heads,))))
        else:  # a GGUF's, -exp(A_log) already
            decay = float32(self.take(d + "decay", (heads,)))
        return DeltaNetWeights(
            in_proj=self.fused([(d + "in_proj_qkv.weight", (channels, H)),
                                (d + "in_proj_z.weight", (shape.values, H)), (d + "in_proj_b.weight", (heads, H)),
                                (d + "in_proj_a.weight", (heads, H))]),
            conv=float32(self.take(d + "conv1d.weight", conv_shape)).reshape(channels, kernel),
            dt_bias=float32(self.take(d + "dt_bias", (heads,))),
            decay=decay,
            norm=float32(self.take(d + "norm.weight", (shape.value_dim,))),
            out_proj=self.take(d + "out_proj.weight", (H, shape.values)))

    def experts(self, i: int) -> Experts:
        """Layer i's router and experts, each expert's tensors read into its rows of the stack
        (under the family's names for them: Family.expert_tensors)."""
        c = self.config
        E, H, I = c.num_experts, c.hidden_size, c.expert_intermediate_size
        moe, names = c.family.expert_tensors(i)
        shared = {}
        if c.shared_expert_size:
            S, gate = c.shared_expert_size, moe + "shared_expert_gate.weight"
            entry = self.tensors.entries.get(gate)
            gate_shape = (H,) if entry is not None and len(entry.shape) == 1 else (1, H)  # a GGUF's is 1-D
            shared = dict(shared_gate_up=self.fused([(f"{moe}shared_expert.{part}_proj.weight", (S, H))
                                                     for part in ("gate", "up")]),
                          shared_down=self.take(moe + "shared_expert.down_proj.weight", (H, S)),
                          shared_gate=float32(self.take(gate, gate_shape)).reshape(1, H))
        router = moe + c.family.router
        biased = dict(router_bias=float32(self.take(router + ".bias", (E,)))) if router + ".bias" in \
            self.tensors.entries else {}
        matrices = c.family.stacked_experts(self.present, i, E, H, I) or {}
        if "gate_up" not in matrices:  # per expert, under the checkpoint's (or a GGUF's) names
            fused = f"{moe}experts.0.gate_up_proj.weight" in self.tensors.entries  # a GGUF's fused stack, per expert
            gate_up = [(f"{moe}experts.{e}.gate_up_proj.weight", (2 * I, H)) for e in range(E)] if fused else \
                [(f"{moe}experts.{e}.{names[part]}.weight", (I, H)) for e in range(E) for part in ("gate", "up")]
            matrices.update(gate_up=self.fused(gate_up),
                            down=self.fused([(f"{moe}experts.{e}.{names['down']}.weight", (H, I)) for e in range(E)]))
            if f"{moe}experts.0.{names['gate']}.bias" in self.tensors.entries:  # a GGUF's GPT-OSS
                matrices.update(
                    gate_up_bias=np.concatenate([float32(self.take(f"{moe}experts.{e}.{names[part]}.bias", (I,)))
                                                 for e in range(E) for part in ("gate", "up")]),
                    down_bias=np.concatenate([float32(self.take(f"{moe}experts.{e}.{names['down']}.bias", (H,)))
                                              for e in range(E)]))
        return Experts(router=self.take(router + ".weight", (E, H)), top_k=c.experts_per_token,
                       normalize=c.norm_topk_prob, swiglu_clamp=c.swiglu_clamp, **matrices, **shared, **biased)

    def present(self, name: str, shape: tuple) -> np.ndarray | None:
        """The tensor in float32, checked against shape; None where the checkpoint lacks it."""
        return float32(self.take(name, shape)) if name in self.tensors.entries else None

    def unread(self, name: str, shape: tuple):
        """The tensor for prepare to read in slabs of rows (tensors.rows)."""
        self.check(name, shape)
        return self.tensors.rows(name)

    def outer(self, prepare: Callable) -> tuple:
        """The embedding, final norm and LM head (the embedding itself when tied), prepared; the
        two large ones handed over unread, so that ops that pack them never hold their float32."""
        c = self.config
        shape = (c.vocab_size, c.hidden_size)
        embed = prepare(self.unread("model.embed_tokens.weight", shape))
        if c.tie_word_embeddings or "lm_head.weight" not in self.tensors.entries:
            lm_head = embed
        else:
            lm_head = prepare(self.unread("lm_head.weight", shape))
        return embed, prepare(self.norm("model.norm.weight", (c.hidden_size,))), lm_head
