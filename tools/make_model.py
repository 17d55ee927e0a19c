"""Random-weight models in real shapes, as GGUF files or Hugging Face directories, with no download.

Shapes: Llama-3.2-1B, Llama-3.1-8B, Qwen3-4B (their matrices, heads, rope and norms), Qwen3-30B-A3B's
mixture of experts cut to 8 of its 48 layers (128 experts of 768, 8 a token: every layer as
the real one's), a Qwen3.5 hybrid of about 2B (Qwen3.5-2B's hidden size, layers and vocabulary;
its other widths Qwen3.5's defaults scaled down; its multi-token-prediction block after the
layers: a GGUF only), GPT-OSS-20B (its every tensor: sinks, biases, 32 experts of 2880, MXFP4
experts under --type mxfp4; a GGUF only), Gemma 4 E2B's language model (per-layer embeddings,
shared K/V, full layers' heads of 512; a GGUF only), `tiny` for tests and `tiny-32k` (one layer, a 32k
context) for agents' long prompts. The tokenizer is a real one already on the machine: the default model's (SmolLM2's
49,152-token byte-level BPE), padded with unused tokens up to the shape's vocabulary, so text
round-trips. Weights are drawn per tensor from (seed, tensor name), a block of rows at a time,
quantized by model/quant/kquants.py and written tensor by tensor: peak memory is about one
tensor (its packed bytes, or its float32 values for f32), not the model. Norm weights are near 1
and projections scaled by 1/sqrt(fan_in), so the forward pass stays finite.

GGUF types: f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k put every matrix in that
type (norms stay F32); q4_k_m is llama-quantize's mix (see tensor_type); mxfp4 is GPT-OSS's
release: MXFP4 experts (random codes and scales, drawn as bytes), every other matrix Q8_0.
HF: f32, f16, bf16.

    python tools/make_model.py --shape llama3.2-1b --type q4_k_m --out /tmp/m.gguf
    python tools/make_model.py --shape qwen3-4b --format hf --type bf16 --out /tmp/qwen3-4b
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.gguf.rope import llama3_rope_factors  # noqa: E402
from model.quant.kquants import quantize  # noqa: E402

T = gguf.GGMLQuantizationType
ROWS_PER_DRAW = 4096  # rows drawn, quantized and written at once: bounds the float32 temporaries


@dataclass(frozen=True)
class Shape:
    arch: str  # general.architecture: llama or qwen3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    context: int
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    experts: int = 0  # a mixture of experts' experts a layer (in place of the MLP); 0: dense
    experts_used: int = 0
    expert_ffn: int = 0
    # a hybrid's gated delta nets (key heads, value heads, key dim, value dim, conv kernel): three
    # of every four layers, the fourth full attention with an output gate and a quarter rotated
    delta_net: tuple[int, int, int, int, int] | None = None
    # GPT-OSS: the window of its even layers, and YaRN's (factor, original context)
    sliding_window: int = 0
    yarn: tuple[float, int] | None = None
    mtp: bool = False  # a multi-token-prediction block after the layers (Qwen3.5's, nextn_predict_layers 1)
    # Gemma 4: (the full layers' head size, every n-th layer full, the last layers reading earlier
    # layers' K/V with double-wide MLPs, per-layer embeddings' width)
    gemma4: tuple[int, int, int, int] | None = None


SHAPES = {
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 1e-5, 131072,
                         (32.0, 1.0, 4.0, 8192)),
    "llama3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 1e-5, 131072,
                         (8.0, 1.0, 4.0, 8192)),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1000000.0, 1e-6, 40960),
    "qwen3-30b-a3b-8l": Shape("qwen3moe", 2048, 8, 32, 4, 128, 6144, 151936, False, 1000000.0, 1e-6, 40960,
                              experts=128, experts_used=8, expert_ffn=768),
    "qwen3.5-2b": Shape("qwen35", 2048, 24, 8, 2, 256, 6144, 248320, True, 10000000.0, 1e-6, 262144,
                        delta_net=(16, 16, 128, 128, 4), mtp=True),
    "gpt-oss-20b": Shape("gpt-oss", 2880, 24, 64, 8, 64, 2880, 201088, False, 150000.0, 1e-5, 131072,
                         experts=32, experts_used=4, expert_ffn=2880, sliding_window=128, yarn=(32.0, 4096)),
    # Gemma 4 E2B's language model: 35 layers of 1536 (every fifth full, heads of 512 there, 256
    # in the sliding ones, one K/V head), the last 20 reading earlier layers' K/V, per-layer
    # embeddings of 256 (a 262,144 x 8,960 table), a window of 512
    "gemma4-e2b": Shape("gemma4", 1536, 35, 8, 1, 256, 6144, 262144, True, 1000000.0, 1e-6, 131072,
                        sliding_window=512, gemma4=(512, 5, 20, 256)),
    # Small, but every matrix has rows of 256 so that K-quants apply, it is untied so that
    # token_embd and output take their own Q4_K_M types, and 128 padding tokens are exercised.
    "tiny": Shape("llama", 256, 2, 4, 2, 64, 512, 49280, False, 10000.0, 1e-5, 2048),
    # One layer of two heads with a context for a coding agent's 20k-token prompt (as HF f32:
    # tests/test_claude_code.py, tools/bench_agent_turns.py); prefill is attention's cost
    "tiny-32k": Shape("llama", 128, 1, 2, 1, 64, 256, 49280, False, 10000.0, 1e-5, 32768),
}
GGUF_TYPES = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0,
              "q5_1": T.Q5_1, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q4_k_m": T.Q4_K, "mxfp4": T.Q8_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k": 14,
              "q4_k_m": 15, "q5_k": 16, "q6_k": 18, "mxfp4": 38}  # llama_ftype (q4_k, q5_k: the _S variants)
HF_TYPES = {"f32": ("F32", np.float32), "f16": ("F16", np.float16), "bf16": ("BF16", np.uint16)}
# llama-quantize's fallback where a row does not fill a K-quant super-block
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
PAD_TYPE = 5  # gguf.TokenType.UNUSED, as llama.cpp's converter marks padding
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1


@dataclass(frozen=True)
class Tensor:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]  # rows, columns (Hugging Face's); experts, rows, columns for a stack of experts
    layer: int | None = None
    permute_heads: int = 0  # llama.cpp's rope row order for the GGUF of architecture llama

    def draw(self, seed: int):
        """Float32 blocks of rows, from (seed, hf_name): the same values in either format."""
        rng = np.random.default_rng([seed, zlib.crc32(self.hf_name.encode())])
        if self.hf_name.endswith("linear_attn.decay"):  # -exp(A_log): decays of 0.6-0.95 a token
            yield -rng.uniform(0.05, 0.5, self.shape).astype(np.float32)
            return
        if self.hf_name.endswith((".bias", "_bias", "sinks")):  # small: near a model's own
            yield (0.05 * rng.standard_normal(self.shape, dtype=np.float32)).reshape(-1, self.shape[-1])
            return
        if len(self.shape) == 1:
            yield (1 + 0.05 * rng.standard_normal(self.shape, dtype=np.float32)).astype(np.float32)
            return
        rows, cols = int(np.prod(self.shape[:-1])), self.shape[-1]
        scale = np.float32(cols ** -0.5)
        for start in range(0, rows, ROWS_PER_DRAW):
            yield rng.standard_normal((min(ROWS_PER_DRAW, rows - start), cols), dtype=np.float32) * scale


def tensors(s: Shape) -> list[Tensor]:
    """The model's tensors in llama.cpp's order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    rope = s.arch == "llama"
    out = [Tensor("model.embed_tokens.weight", "token_embd.weight", (s.vocab, s.hidden))]
    if s.gemma4:
        width = s.layers * s.gemma4[3]
        out += [Tensor("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight", (s.vocab, width)),
                Tensor("model.per_layer_model_projection.weight", "per_layer_model_proj.weight", (width, s.hidden)),
                Tensor("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight", (s.gemma4[3],))]
    for i in range(s.layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        if s.delta_net:
            out += hybrid_layer(s, i)
            continue
        if s.arch == "gpt-oss":
            out += gpt_oss_layer(s, i)
            continue
        if s.gemma4:
            out += gemma4_layer(s, i)
            continue
        out += [
            Tensor(hf + "input_layernorm.weight", gg + "attn_norm.weight", (s.hidden,), i),
            Tensor(hf + "self_attn.q_proj.weight", gg + "attn_q.weight", (q, s.hidden), i, s.heads * rope),
            Tensor(hf + "self_attn.k_proj.weight", gg + "attn_k.weight", (kv, s.hidden), i, s.kv_heads * rope),
            Tensor(hf + "self_attn.v_proj.weight", gg + "attn_v.weight", (kv, s.hidden), i),
            Tensor(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (s.hidden, q), i),
        ]
        if s.arch in ("qwen3", "qwen3moe"):
            out += [Tensor(hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight", (s.head_dim,), i),
                    Tensor(hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight", (s.head_dim,), i)]
        out.append(Tensor(hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (s.hidden,), i))
        if s.experts:  # the router, then each part of the experts as llama.cpp stacks them
            e, f = s.experts, s.expert_ffn
            out += [Tensor(hf + "mlp.gate.weight", gg + "ffn_gate_inp.weight", (e, s.hidden), i),
                    Tensor(hf + "mlp.experts.gate_proj", gg + "ffn_gate_exps.weight", (e, f, s.hidden), i),
                    Tensor(hf + "mlp.experts.up_proj", gg + "ffn_up_exps.weight", (e, f, s.hidden), i),
                    Tensor(hf + "mlp.experts.down_proj", gg + "ffn_down_exps.weight", (e, s.hidden, f), i)]
            continue
        out += [
            Tensor(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (s.ffn, s.hidden), i),
            Tensor(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (s.ffn, s.hidden), i),
            Tensor(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (s.hidden, s.ffn), i),
        ]
    if s.mtp:
        out += mtp_block(s)
    out.append(Tensor("model.norm.weight", "output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(Tensor("lm_head.weight", "output.weight", (s.vocab, s.hidden)))
    return out


def hybrid_layer(s: Shape, i: int) -> list[Tensor]:
    """A Qwen3.5 layer's tensors under llama.cpp's names: a gated delta net (three layers of
    four) or gated full attention, then the MLP."""
    hf, gg = f"model.layers.{i}.", f"blk.{i}."
    key_heads, value_heads, key_dim, value_dim, kernel = s.delta_net
    channels, values = 2 * key_heads * key_dim + value_heads * value_dim, value_heads * value_dim
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [Tensor(hf + "input_layernorm.weight", gg + "attn_norm.weight", (s.hidden,), i)]
    d = hf + "linear_attn."
    if (i + 1) % 4:
        out += [Tensor(d + "in_proj_qkv.weight", gg + "attn_qkv.weight", (channels, s.hidden), i),
                Tensor(d + "in_proj_z.weight", gg + "attn_gate.weight", (values, s.hidden), i),
                Tensor(d + "in_proj_b.weight", gg + "ssm_beta.weight", (value_heads, s.hidden), i),
                Tensor(d + "in_proj_a.weight", gg + "ssm_alpha.weight", (value_heads, s.hidden), i),
                Tensor(d + "conv1d.weight", gg + "ssm_conv1d.weight", (channels, kernel), i),
                Tensor(d + "dt_bias", gg + "ssm_dt.bias", (value_heads,), i),
                Tensor(d + "decay", gg + "ssm_a", (value_heads,), i),
                Tensor(d + "norm.weight", gg + "ssm_norm.weight", (value_dim,), i),
                Tensor(d + "out_proj.weight", gg + "ssm_out.weight", (s.hidden, values), i)]
    else:
        a = hf + "self_attn."
        out += [Tensor(a + "q_proj.weight", gg + "attn_q.weight", (2 * q, s.hidden), i),
                Tensor(a + "k_proj.weight", gg + "attn_k.weight", (kv, s.hidden), i),
                Tensor(a + "v_proj.weight", gg + "attn_v.weight", (kv, s.hidden), i),
                Tensor(a + "o_proj.weight", gg + "attn_output.weight", (s.hidden, q), i),
                Tensor(a + "q_norm.weight", gg + "attn_q_norm.weight", (s.head_dim,), i),
                Tensor(a + "k_norm.weight", gg + "attn_k_norm.weight", (s.head_dim,), i)]
    return out + [
        Tensor(hf + "post_attention_layernorm.weight", gg + "post_attention_norm.weight", (s.hidden,), i),
        Tensor(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (s.ffn, s.hidden), i),
        Tensor(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (s.ffn, s.hidden), i),
        Tensor(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (s.hidden, s.ffn), i)]


def mtp_block(s: Shape) -> list[Tensor]:
    """Qwen3.5's multi-token-prediction block as llama.cpp's converter writes it, under blk.N
    after the N layers: a full-attention layer (a hybrid's fourth, renamed) and its own fc and
    norms (blk.N.nextn.*), drawn from the checkpoint's mtp.* names."""
    n, attention = s.layers, hybrid_layer(s, 3)
    layer = [replace(t, hf_name=t.hf_name.replace("model.layers.3.", "mtp.layers.0."),
                     gguf_name=t.gguf_name.replace("blk.3.", f"blk.{n}."), layer=n) for t in attention]
    own = [Tensor("mtp.fc.weight", f"blk.{n}.nextn.eh_proj.weight", (s.hidden, 2 * s.hidden), n)]
    own += [Tensor(f"mtp.{hf}.weight", f"blk.{n}.nextn.{gg}.weight", (s.hidden,), n) for hf, gg in (
        ("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"), ("norm", "shared_head_norm"))]
    return layer + own


def gemma4_full(s: Shape, i: int) -> bool:
    return (i + 1) % s.gemma4[1] == 0 or i == s.layers - 1


def gemma4_layer(s: Shape, i: int) -> list[Tensor]:
    """A Gemma 4 layer under llama.cpp's names: a full layer's own head size, no K/V of its own
    in the last layers (their MLPs twice as wide), the per-layer input's gate and projection,
    its output scalar."""
    hf, gg, a = f"model.layers.{i}.", f"blk.{i}.", f"model.layers.{i}.self_attn."
    dim = s.gemma4[0] if gemma4_full(s, i) else s.head_dim
    shared = i >= s.layers - s.gemma4[2]
    ffn, per_layer = s.ffn * (2 if shared else 1), s.gemma4[3]
    out = [Tensor(hf + "input_layernorm.weight", gg + "attn_norm.weight", (s.hidden,), i),
           Tensor(a + "q_proj.weight", gg + "attn_q.weight", (s.heads * dim, s.hidden), i),
           Tensor(a + "q_norm.weight", gg + "attn_q_norm.weight", (dim,), i)]
    if not shared:
        out += [Tensor(a + "k_proj.weight", gg + "attn_k.weight", (s.kv_heads * dim, s.hidden), i),
                Tensor(a + "v_proj.weight", gg + "attn_v.weight", (s.kv_heads * dim, s.hidden), i),
                Tensor(a + "k_norm.weight", gg + "attn_k_norm.weight", (dim,), i)]
    return out + [
        Tensor(a + "o_proj.weight", gg + "attn_output.weight", (s.hidden, s.heads * dim), i),
        Tensor(hf + "post_attention_layernorm.weight", gg + "post_attention_norm.weight", (s.hidden,), i),
        Tensor(hf + "pre_feedforward_layernorm.weight", gg + "ffn_norm.weight", (s.hidden,), i),
        Tensor(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (ffn, s.hidden), i),
        Tensor(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (ffn, s.hidden), i),
        Tensor(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (s.hidden, ffn), i),
        Tensor(hf + "post_feedforward_layernorm.weight", gg + "post_ffw_norm.weight", (s.hidden,), i),
        Tensor(hf + "per_layer_input_gate.weight", gg + "inp_gate.weight", (per_layer, s.hidden), i),
        Tensor(hf + "per_layer_projection.weight", gg + "proj.weight", (s.hidden, per_layer), i),
        Tensor(hf + "post_per_layer_input_norm.weight", gg + "post_norm.weight", (s.hidden,), i),
        Tensor(hf + "layer_scalar", gg + "layer_output_scale.weight", (1,), i)]


def gemma4_metadata(w: gguf.GGUFWriter, s: Shape) -> None:
    """What conversion/gemma.py's Gemma4Model writes beyond the common keys."""
    full_dim, _, shared, per_layer = s.gemma4
    w.add_feed_forward_length([s.ffn * (2 if i >= s.layers - shared else 1) for i in range(s.layers)])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(s.head_dim)
    w.add_value_length_swa(s.head_dim)
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(s.head_dim)
    w.add_float32(f"{s.arch}.rope.freq_base_swa", 10000.0)
    w.add_sliding_window_pattern([not gemma4_full(s, i) for i in range(s.layers)])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(per_layer)
    w.add_final_logit_softcapping(30.0)


def gpt_oss_layer(s: Shape, i: int) -> list[Tensor]:
    """A GPT-OSS layer under llama.cpp's names: biased attention with sinks, the biased router
    and experts (the 3-D stacks, their biases one row an expert)."""
    hf, gg, a = f"model.layers.{i}.", f"blk.{i}.", f"model.layers.{i}.self_attn."
    q, kv, e, f = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts, s.expert_ffn
    out = [Tensor(hf + "input_layernorm.weight", gg + "attn_norm.weight", (s.hidden,), i)]
    for part, gguf_part, rows in (("q", "q", q), ("k", "k", kv), ("v", "v", kv)):
        out += [Tensor(f"{a}{part}_proj.weight", f"{gg}attn_{gguf_part}.weight", (rows, s.hidden), i),
                Tensor(f"{a}{part}_proj.bias", f"{gg}attn_{gguf_part}.bias", (rows,), i)]
    out += [Tensor(a + "o_proj.weight", gg + "attn_output.weight", (s.hidden, q), i),
            Tensor(a + "o_proj.bias", gg + "attn_output.bias", (s.hidden,), i),
            Tensor(a + "sinks", gg + "attn_sinks.weight", (s.heads,), i),
            Tensor(hf + "post_attention_layernorm.weight", gg + "post_attention_norm.weight", (s.hidden,), i),
            Tensor(hf + "mlp.router.weight", gg + "ffn_gate_inp.weight", (e, s.hidden), i),
            Tensor(hf + "mlp.router.bias", gg + "ffn_gate_inp.bias", (e,), i)]
    for part, rows, cols in (("gate", f, s.hidden), ("up", f, s.hidden), ("down", s.hidden, f)):
        out += [Tensor(f"{hf}mlp.experts.{part}_proj", f"{gg}ffn_{part}_exps.weight", (e, rows, cols), i),
                Tensor(f"{hf}mlp.experts.{part}_proj_bias", f"{gg}ffn_{part}_exps.bias", (e, rows), i)]
    return out


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of layers for more bits: the first and last eighth, and every
    third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(t: Tensor, kind: str, s: Shape) -> T:
    """The GGUF type of t. q4_k_m, as llama-quantize (llama_tensor_get_type) picks for a dense
    model without an importance matrix: Q6_K for output.weight (for token_embd.weight when the
    model is tied and it serves as the output), Q6_K for attn_v and ffn_down in the layers of
    use_more_bits, Q4_K for every other matrix. Norms stay F32; a matrix whose rows do not fit
    the type's blocks falls back as llama-quantize does (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
    Q8_0, else F16)."""
    if len(t.shape) == 1 or t.gguf_name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight", ".bias")):
        return T.F32  # llama.cpp keeps routers, convolutions and biases F32
    qtype = GGUF_TYPES[kind]
    if kind == "mxfp4" and t.gguf_name.endswith("_exps.weight"):
        return T.MXFP4
    if kind == "q4_k_m":
        output = t.gguf_name == "output.weight" or (s.tied and t.gguf_name == "token_embd.weight")
        more = t.gguf_name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(t.layer, s.layers)
        qtype = T.Q6_K if output or more else T.Q4_K
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if t.shape[-1] % block:
        qtype = FALLBACK.get(qtype, T.F16)
        if t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F16
    return qtype


def encoded(t: Tensor, qtype: T, seed: int) -> np.ndarray:
    """t's values in qtype's bytes (uint8 rows), or as float16/float32, filled a block of rows
    at a time into one array."""

    if qtype == T.MXFP4:  # codes and scales drawn as bytes: quantizing 18B weights takes half an hour
        return random_mxfp4(t, seed)

    def encode(part: np.ndarray) -> np.ndarray:
        if qtype in (T.F32, T.F16):
            return part.astype(np.float16 if qtype == T.F16 else np.float32)
        return quantize(part, qtype)

    parts = t.draw(seed)
    if len(t.shape) == 1:
        return encode(next(parts))
    if t.permute_heads:  # q/k rows: interleave each head's two rotary halves, as llama.cpp stores them
        w = np.concatenate(list(parts))
        parts = [w.reshape(t.permute_heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)]
    out, row = None, 0
    for part in parts:
        values = encode(part)
        if out is None:
            out = np.empty((int(np.prod(t.shape[:-1])), values.shape[1]), dtype=values.dtype)
        out[row:row + len(values)] = values
        row += len(values)
    return out


def random_mxfp4(t: Tensor, seed: int) -> np.ndarray:
    """MXFP4 blocks of uniform random 4-bit codes under one scale byte a block, 2^-8 to 2^-6:
    values of about 1/sqrt(fan_in) for GPT-OSS's widths, as the other types' draws are."""
    rng = np.random.default_rng([seed, zlib.crc32(t.hf_name.encode())])
    rows, blocks = int(np.prod(t.shape[:-1])), t.shape[-1] // 32
    out = rng.integers(0, 256, (rows, blocks, 17), dtype=np.uint8)
    out[:, :, 0] = rng.integers(119, 122, (rows, blocks), dtype=np.uint8)
    return out.reshape(rows, blocks * 17)


def tokenizer_source() -> Path:
    """The default model's directory (converted from its GGUF): its tokenizer is the one used."""
    from model.default import default_model_dir

    return default_model_dir(progress=False)


def padded_vocab(source: Path, size: int) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens, GGUF token types, merges, tokenizer.json) padded with [PAD<id>] to size tokens."""
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    if size < len(vocab):
        raise SystemExit(f"the shape's vocabulary ({size}) is smaller than the tokenizer's ({len(vocab)})")
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [NORMAL] * len(tokens)
    for added in spec["added_tokens"]:
        types[added["id"]] = CONTROL if added["special"] else USER_DEFINED
    for i in range(len(tokens), size):
        tokens.append(f"[PAD{i}]")
        types.append(PAD_TYPE)
        vocab[tokens[i]] = i  # never produced by a merge, so encoding is unchanged; decodes as written
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, spec


def write_gguf(path: Path, s: Shape, kind: str, seed: int, shape_name: str) -> None:
    source = tokenizer_source()
    tokens, types, merges, _ = padded_vocab(source, s.vocab)
    config = json.loads((source / "tokenizer_config.json").read_text())
    generation = json.loads((source / "generation_config.json").read_text())
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"random {shape_name}")
    w.add_file_type(FILE_TYPES[kind])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(s.layers + s.mtp)
    if s.mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    if s.gemma4:
        gemma4_metadata(w, s)
    else:
        w.add_feed_forward_length(s.ffn)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_dimension_count(s.head_dim // 4 if s.delta_net else s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.vocab)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.yarn[1])
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.delta_net:
        key_heads, value_heads, key_dim, value_dim, kernel = s.delta_net
        w.add_ssm_conv_kernel(kernel)
        w.add_ssm_state_size(key_dim)
        w.add_ssm_group_count(key_heads)
        w.add_ssm_time_step_rank(value_heads)
        w.add_ssm_inner_size(value_heads * value_dim)
        w.add_full_attention_interval(4)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(generation["bos_token_id"])
    w.add_eos_token_id(generation["eos_token_id"])
    w.add_add_bos_token(bool(config.get("add_bos_token", False)))
    w.add_chat_template(config["chat_template"])

    plan = [(t, tensor_type(t, kind, s)) for t in tensors(s)]
    extra = []
    if s.llama3_rope:
        factors = llama3_rope_factors(s.head_dim, s.rope_theta, *s.llama3_rope).astype(np.float32)
        extra.append(("rope_freqs.weight", factors))
    if s.gemma4:  # the full layers' proportional rotation: a quarter of the pairs turn
        pairs = s.gemma4[0] // 2
        extra.append(("rope_freqs.weight", np.array([1.0] * (pairs // 4) + [1e30] * (pairs - pairs // 4), np.float32)))
    for name, values in extra:
        w.add_tensor_info(name, values.shape, values.dtype, values.nbytes)
    for t, qtype in plan:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = np.prod(t.shape[:-1], dtype=np.int64) * (t.shape[-1] // block) * size
        w.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), int(nbytes), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, values in extra:
        w.write_tensor_data(values)
    for t, qtype in plan:
        w.write_tensor_data(encoded(t, qtype, seed))
    w.close()


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 (as uint16), rounding to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_hf(out: Path, s: Shape, kind: str, seed: int) -> None:
    source = tokenizer_source()
    out.mkdir(parents=True, exist_ok=True)
    _, _, _, spec = padded_vocab(source, s.vocab)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(source / name, out / name)
    generation = json.loads((source / "generation_config.json").read_text())
    if s.experts or s.delta_net:
        raise SystemExit("a mixture of experts' or a hybrid's shape is written as a GGUF only (--format gguf)")
    model_type, arch = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}[s.arch]
    rope_scaling = None
    if s.llama3_rope:
        factor, low, high, original = s.llama3_rope
        rope_scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    config = {
        "architectures": [arch], "model_type": model_type, "hidden_size": s.hidden,
        "intermediate_size": s.ffn, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "hidden_act": "silu",
        "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": s.context, "vocab_size": s.vocab, "tie_word_embeddings": s.tied,
        "attention_bias": False, "bos_token_id": generation["bos_token_id"],
        "eos_token_id": generation["eos_token_id"], "torch_dtype": {"f32": "float32", "f16": "float16",
                                                                    "bf16": "bfloat16"}[kind],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    code, dtype = HF_TYPES[kind]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    plan = tensors(s)
    for t in plan:
        nbytes = int(np.prod(t.shape)) * np.dtype(dtype).itemsize
        header[t.hf_name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in plan:
            for part in t.draw(seed):
                f.write((bfloat16_bits(part) if kind == "bf16" else part.astype(dtype)).tobytes())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--format", choices=("gguf", "hf"), default="gguf")
    p.add_argument("--type", help="gguf: f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k,"
                   " q4_k_m (default), mxfp4 (MXFP4 experts, the rest q8_0); hf: f32, f16, bf16 (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the .gguf file, or the HF directory")
    a = p.parse_args(argv)
    kinds = GGUF_TYPES if a.format == "gguf" else HF_TYPES
    kind = a.type or ("q4_k_m" if a.format == "gguf" else "bf16")
    if kind not in kinds:
        p.error(f"--type for {a.format} is one of {', '.join(kinds)}")
    start = time.perf_counter()
    if a.format == "hf" and SHAPES[a.shape].gemma4:
        p.error(f"--shape {a.shape} is written as a GGUF only")
    if a.format == "gguf":
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(a.out, SHAPES[a.shape], kind, a.seed, a.shape)
        size = a.out.stat().st_size
    else:
        write_hf(a.out, SHAPES[a.shape], kind, a.seed)
        size = sum(f.stat().st_size for f in a.out.iterdir())
    print(f"{a.out}: {a.shape} {kind}, {size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
