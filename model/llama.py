"""The Llama-family forward pass, written once against the Ops protocol (NumPy or CuPy arrays).

One call runs a whole engine step: every row's tokens (prefill chunks and decode tokens) are
laid end to end on one token axis, so each projection is a single GEMM, and attention reads
K/V through the rows' block tables.
"""

import math
from dataclasses import replace

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
        self.windows = config.layer_windows or (0,) * config.num_layers
        full = next((config.head_dim_of(i) for i, w in enumerate(self.windows) if not w), config.head_dim)
        tables = {"global": rope_tables(replace(config, head_dim=full), positions)}
        if config.local_rope_theta is not None:  # sliding layers with their own theta, unscaled, whole
            tables["local"] = rope_tables(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None,
                                                  partial_rotary_factor=1.0), positions)
        rotates = config.rope_layers or (True,) * config.num_layers
        if not all(rotates):  # layers without rotation: the identity's table
            tables["still"] = np.ones_like(tables["global"][0]), np.zeros_like(tables["global"][1])
        self.layer_rope = ["still" if not rotates[i] else "local" if self.windows[i] and "local" in tables
                           else "global" for i in range(config.num_layers)]
        self.tables = {kind: (ops.asarray(cos), ops.asarray(sin)) for kind, (cos, sin) in tables.items()}
        self.w = weights
        self.scale = config.query_scale or 1.0 / math.sqrt(config.head_dim)
        self.embed_scale = embedding_scale(config)
        self.temperature = None  # Llama 4's query temperature by position (Ministral 3)
        if config.attention_temperature is not None:
            beta, every = config.attention_temperature
            steps = np.floor(np.arange(positions) / every)
            self.temperature = ops.asarray((1 + beta * np.log1p(steps)).astype(np.float32))
        self.per_layer_scale = math.sqrt(config.per_layer_input) * 0.5 ** 0.5  # the sum's 2 ** -0.5 in it

    @property
    def weight_bytes(self) -> int:
        """What the weights hold in memory (a tied LM head counted once)."""
        arrays = [self.w.embed, self.w.norm, self.w.per_layer,
                  *(v for layer in self.w.layers for v in vars(layer).values() if not isinstance(v, float))]
        if self.w.lm_head is not self.w.embed:
            arrays.append(self.w.lm_head)
        return sum(a.nbytes for a in arrays if a is not None)

    def forward(self, token_ids, positions, slots, attn_meta, cache, logit_index, pooled_index=None,
                state_rows=None, adapters=None, logits_out=None):
        """Hidden states for all tokens of a step, K/V written to the cache (and a hybrid model's
        delta-net state to the slots of state_rows, kv_cache.StateRows), and logits (fp32)
        for the tokens at logit_index only; with pooled_index, (those logits, the final
        normalised hidden states of the tokens at pooled_index: embedding rows'). adapters:
        the step's LoRA adapters (model/lora.StepAdapters), None where no row has one; logits_out:
        where the logits go (the decode graphs' shared buffer), a new array when None.

        The residual stream x is only ever touched through ops (add_rms_norm adds each block's
        output, delta, and normalises in one pass), so the arrays may hold any storage type."""
        ops, c, w = self.ops, self.config, self.w
        eps = c.rms_norm_eps
        rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in self.tables.items()}
        temperature = None if self.temperature is None else self.temperature[positions]
        x, delta = ops.embedding(w.embed, token_ids, self.embed_scale), None
        per_layer = None if w.per_layer is None else self.per_layer_inputs(x, token_ids)
        for i, layer in enumerate(w.layers):
            cos, sin = rows[self.layer_rope[i]]
            x, h = ops.add_rms_norm(x, delta, layer.attn_norm, eps)
            if layer.delta_net is not None:
                proj = ops.linear(h, layer.delta_net.in_proj)
                state_rows.keep(i, proj)  # a row with guesses may need them again (model/rewind.py)
                net = ops.gated_delta_net(proj, layer.delta_net, c.delta_net, cache.conv[i], cache.recurrent[i],
                                          state_rows, eps)
                x, h = ops.add_rms_norm(x, ops.linear(net, layer.delta_net.out_proj), layer.mlp_norm, eps)
                delta = self.mlp(h, layer, adapters=adapters, i=i)
                continue
            out = self.attention(h, layer, i, cos, sin, slots, attn_meta, cache, temperature, self.windows[i],
                                 adapters)
            x, h = ops.add_rms_norm(x, out, layer.mlp_norm, eps)
            delta = self.mlp(h, layer, x, adapters, i)
            if layer.scalar is not None:
                x, delta = self.layer_end(x, delta, layer, None if per_layer is None else per_layer[:, i]), None
        _, h = ops.add_rms_norm(x[logit_index], None if delta is None else delta[logit_index], w.norm, eps)
        logits = ops.logits(h, w.lm_head, c.final_softcap, logits_out)
        if pooled_index is None:
            return logits
        return logits, ops.add_rms_norm(x[pooled_index], None if delta is None else delta[pooled_index], w.norm,
                                        eps)[1]

    def attention(self, h, layer, i: int, cos, sin, slots, attn_meta, cache, temperature, window: int,
                  adapters=None):
        """The attention of layer (the cache's layer i) over the normalised stream h, its K/V
        written first (unless it reads an earlier layer's), through its output projection (and
        post-attention norm); adapters: the step's LoRA (model/lora.StepAdapters) or None."""
        ops, c = self.ops, self.config
        eps, tokens, source = c.rms_norm_eps, h.shape[0], c.kv_source(i)
        Q, D = c.q_size_of(i), c.head_dim_of(i)
        qkv = self.project(h, layer.wqkv, layer.bqkv, adapters, i, "wqkv")
        if source == i:  # the norms, rotations and K/V write in one kernel
            q = ops.rope_and_cache(qkv, cos, sin, cache.k[i], cache.v[i], slots, c.num_heads, q_norm=layer.q_norm,
                                   k_norm=layer.k_norm, v_norm=layer.v_norm, eps=eps)
        else:  # q alone: this layer reads an earlier layer's K/V (Gemma 4's last layers)
            q = qkv[:, :Q].reshape(tokens, c.num_heads, D)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, eps)
            q = ops.rope(q, cos, sin)
        if temperature is not None:
            q = ops.scale_tokens(q, temperature)
        attn = ops.paged_attention(q, cache.k[source], cache.v[source], attn_meta, self.scale, window,
                                   c.attn_softcap, layer.sinks)
        if c.attention_gate:
            attn = ops.sigmoid_mul(attn, qkv[:, Q:2 * Q])
        out = self.project(attn, layer.wo, layer.bo, adapters, i, "wo")
        if layer.post_attn_norm is not None:
            out = ops.rms_norm(out, layer.post_attn_norm, eps)
        return out

    def mlp(self, h, layer, x=None, adapters=None, i: int = 0):
        """The MLP (or the mixture of experts) of a normalised residual, its output normalised
        where the family has a post-MLP norm; experts beside the MLP read the stream x itself."""
        ops, c = self.ops, self.config
        eps = c.rms_norm_eps
        if layer.experts is not None and layer.expert_norms is None:
            delta = ops.moe(h, layer.experts, c.gelu)
        else:
            gate_up = self.project(h, layer.w_gate_up, None, adapters, i, "w_gate_up")
            delta = self.project(ops.gelu_and_mul(gate_up) if c.gelu else ops.silu_and_mul(gate_up), layer.w_down,
                                 None, adapters, i, "w_down")
        if layer.expert_norms is not None:
            n = layer.expert_norms
            routed = ops.moe(ops.rms_norm(x, n.experts_in, eps), layer.experts, c.gelu, ops.rms_norm(x, n.router, eps))
            delta, _ = ops.add_rms_norm(ops.rms_norm(delta, n.mlp_out, eps), ops.rms_norm(routed, n.experts_out, eps),
                                        n.mlp_out, eps)  # the sum; its norm unused
        if layer.post_mlp_norm is not None:
            delta = ops.rms_norm(delta, layer.post_mlp_norm, eps=eps)
        return delta

    def project(self, x, w, bias, adapters, i: int, weight: str):
        """x through the projection w (layer i's field `weight`), with the step's LoRA adapters'
        share added where a row has one (model/lora.py)."""
        y = self.ops.linear(x, w, bias)
        return y if adapters is None else adapters.add(y, x, i, weight)

    def per_layer_inputs(self, x, token_ids):
        """Gemma 4's per-layer inputs, (tokens, layers, width): each token's rows of the table plus
        the normalised projection of its embedding x, their sum times 2 ** -0.5 (in both)."""
        ops, c, table = self.ops, self.config, self.w.per_layer
        shape = (x.shape[0] * c.num_layers, c.per_layer_input)
        rows = ops.embedding(table.table, token_ids, self.per_layer_scale).reshape(shape)
        projected = ops.rms_norm(ops.linear(x, table.proj).reshape(shape), table.norm, c.rms_norm_eps)
        return ops.add_rms_norm(rows, projected, table.norm, c.rms_norm_eps)[0].reshape(x.shape[0], c.num_layers, -1)

    def layer_end(self, x, delta, layer, per_layer):
        """Gemma 4's end of a layer: the MLP's output added, then the gated residual of the
        layer's per-layer inputs (per_layer: (tokens, width)), then the whole stream times the
        layer's scalar."""
        ops, eps = self.ops, self.config.rms_norm_eps
        x, _ = ops.add_rms_norm(x, delta, layer.attn_norm, eps)  # the stream whole; its norm unused
        if layer.per_layer is not None:
            p = layer.per_layer
            gated = ops.gelu_and_mul(ops.xp.concatenate([ops.linear(x, p.gate), per_layer], axis=1))
            x, _ = ops.add_rms_norm(x, ops.rms_norm(ops.linear(gated, p.proj), p.norm, eps), layer.attn_norm, eps)
        if layer.scalar == 1.0:
            return x
        return ops.scale_tokens(x, ops.xp.full(x.shape[0], layer.scalar, dtype=np.float32))


def embedding_scale(config: ModelConfig) -> float:
    """sqrt(hidden) where the family scales its embedding (Family.scaled_embedding), rounded to
    bfloat16 for a bfloat16 checkpoint as transformers and vLLM round it (33.75 for 1152, not
    33.94), in float32 for the rest (a GGUF's, as llama.cpp does); 1 for the other families."""
    if not config.family.scaled_embedding:
        return 1.0
    scale = np.float32(math.sqrt(config.hidden_size))
    if config.torch_dtype == "bfloat16":  # round to nearest even on the upper 16 bits
        bits = int(scale.view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        scale = np.uint32(bits).view(np.float32)
    return float(scale)
