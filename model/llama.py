"""The Llama-family forward pass, written once against the Ops protocol (NumPy or CuPy arrays).

One call runs a whole engine step: every row's tokens (prefill chunks and decode tokens) are
laid end to end on one token axis, so each projection is a single GEMM, and attention reads
K/V through the rows' block tables.
"""

import math

import numpy as np

from model.config import ModelConfig
from model.ops.protocol import Ops
from model.weights import Weights


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies, with linear or llama3 scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(wavelen > old_len / low, inv_freq / factor,
                            np.where(wavelen < old_len / high, inv_freq, blended))
    return inv_freq


class Llama:
    """Weights on the ops' device, and the forward pass over them."""

    def __init__(self, config: ModelConfig, weights: Weights, ops: Ops, max_positions: int | None = None):
        """weights: already as the ops keep them (model.weights.load_weights with ops.weight)."""
        self.config = config
        self.ops = ops
        positions = max_positions or config.max_position_embeddings
        angles = np.arange(positions, dtype=np.float64)[:, None] * rope_inv_freq(config)[None, :]
        self.cos = ops.asarray(np.cos(angles))
        self.sin = ops.asarray(np.sin(angles))
        self.w = weights
        self.scale = 1.0 / math.sqrt(config.head_dim)

    @property
    def weight_bytes(self) -> int:
        """What the weights hold in memory (a tied LM head counted once)."""
        arrays = [self.w.embed, self.w.norm, *(v for layer in self.w.layers for v in vars(layer).values())]
        if self.w.lm_head is not self.w.embed:
            arrays.append(self.w.lm_head)
        return sum(a.nbytes for a in arrays if a is not None)

    def forward(self, token_ids, positions, slots, attn_meta, cache, logit_index):
        """Hidden states for all tokens of a step, K/V written to the cache, and logits (fp32)
        for the tokens at logit_index only.

        The residual stream x is only ever touched through ops (add_rms_norm adds each block's
        output, delta, and normalises in one pass), so the arrays may hold any storage type."""
        ops, c, w = self.ops, self.config, self.w
        eps = c.rms_norm_eps
        tokens = token_ids.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]
        x, delta = ops.embedding(w.embed, token_ids), None
        for i, layer in enumerate(w.layers):
            x, h = ops.add_rms_norm(x, delta, layer.attn_norm, eps)
            qkv = ops.linear(h, layer.wqkv, layer.bqkv)
            if layer.q_norm is None:
                q = ops.rope_and_cache(qkv, cos, sin, cache.k[i], cache.v[i], slots, c.num_heads)
            else:  # Qwen3: each head normalised before the rotation
                q = qkv[:, :c.q_size].reshape(tokens, c.num_heads, c.head_dim)
                k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(tokens, c.num_kv_heads, c.head_dim)
                v = qkv[:, c.q_size + c.kv_size:].reshape(tokens, c.num_kv_heads, c.head_dim)
                q = ops.rope(ops.rms_norm(q, layer.q_norm, eps), cos, sin)
                ops.write_kv(cache.k[i], cache.v[i], slots, ops.rope(ops.rms_norm(k, layer.k_norm, eps), cos, sin), v)
            attn = ops.paged_attention(q, cache.k[i], cache.v[i], attn_meta, self.scale)
            x, h = ops.add_rms_norm(x, ops.linear(attn, layer.wo), layer.mlp_norm, eps)
            delta = ops.linear(ops.silu_and_mul(ops.linear(h, layer.w_gate_up)), layer.w_down)
        _, h = ops.add_rms_norm(x[logit_index], delta[logit_index], w.norm, eps)
        return ops.logits(h, w.lm_head)
