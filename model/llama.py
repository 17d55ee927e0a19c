"""The Llama-family forward pass, written once against the Ops protocol (NumPy or CuPy arrays).

One call runs a whole engine step: every row's tokens (prefill chunks and decode tokens) are
laid end to end on one token axis, so each projection is a single GEMM, and attention reads
K/V through the rows' block tables.
"""

import math

import numpy as np

from model.config import ModelConfig
from model.ops.protocol import Ops
from model.rope import rope_tables
from model.weights import Weights


class Llama:
    """Weights on the ops' device, and the forward pass over them."""

    def __init__(self, config: ModelConfig, weights: Weights, ops: Ops, max_positions: int | None = None):
        """weights: already as the ops keep them (model.weights.load_weights with ops.weight)."""
        self.config = config
        self.ops = ops
        positions = max_positions or config.max_position_embeddings
        cos, sin = rope_tables(config, positions)
        self.cos, self.sin = ops.asarray(cos), ops.asarray(sin)
        self.rotates = config.rope_layers or (True,) * config.num_layers
        if not all(self.rotates):  # SmolLM3's layers without rotation: the identity's table
            self.cos_still, self.sin_still = ops.asarray(np.ones_like(cos)), ops.asarray(np.zeros_like(sin))
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
        turning = self.cos[positions], self.sin[positions]
        still = (self.cos_still[positions], self.sin_still[positions]) if not all(self.rotates) else None
        x, delta = ops.embedding(w.embed, token_ids), None
        for i, layer in enumerate(w.layers):
            cos, sin = turning if self.rotates[i] else still
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
