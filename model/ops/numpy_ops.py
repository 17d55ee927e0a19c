"""The reference backend: every op of the forward pass and the sampler, in float32 NumPy.

CI runs this, and every CUDA kernel is tested against it. Attention is a few batched calls per
chunk of rows, never a Python loop over heads or tokens: rows are sorted by query count and
context length and taken a few at a time, each chunk padded only to its own longest row.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from model.ops import delta_rule
from model.ops.moe import ExpertPlan, add_bias, clamped_swiglu, combine, route
from model.ops.numpy_sampling import log_softmax, most_likely, sample_rows
from model.ops.protocol import SCALE_BYTES, Download, SampleBatch, SampleResult, Scored
from model.quant.quantized import float32
from model.weights import Experts

# Attention chunks: at most this many rows, and padding to at most this share of the chunk.
ATTENTION_CHUNK_ROWS = 8
ATTENTION_CHUNK_SLACK = 1.25
# Up to this many tokens, a projection runs as (w @ x.T).T, which OpenBLAS computes 1.2-1.5x
# faster than x @ w.T for a few rows (measured with numpy 2.4's OpenBLAS 0.3.31, SkylakeX).
SKINNY_ROWS = 64


@dataclass
class AttentionChunk:
    """Rows attended together: their queries and key blocks gathered into padded arrays."""

    query_index: np.ndarray  # (rows, max_queries) into the step's flat token axis
    query_valid: np.ndarray  # (rows, max_queries) bool
    key_blocks: np.ndarray  # (rows, max_blocks) block ids, padding clipped to block 0
    bias: np.ndarray  # (1, rows, 1, max_queries, max_blocks * block_size): 0 or -inf
    query_pos: np.ndarray  # (rows, max_queries) each query's position
    windowed: dict = field(default_factory=dict)  # sliding window -> bias with keys before it hidden too

    def bias_for(self, window: int) -> np.ndarray:
        """The bias of a layer that sees only the last `window` positions (0: all of them)."""
        if not window:
            return self.bias
        if window not in self.windowed:
            key_pos = np.arange(self.bias.shape[-1])
            early = key_pos[None, None, :] <= self.query_pos[:, :, None] - window  # (rows, max_q, keys)
            self.windowed[window] = np.where(early[None, :, None], np.float32(-np.inf), self.bias)
        return self.windowed[window]


def into(out: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """x, copied into out where one is given (Ops.logits' out)."""
    if out is None:
        return x
    out[...] = x
    return out


def soft_capped(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap) in place, or x itself for cap 0."""
    if cap:
        x /= np.float32(cap)
        np.tanh(x, out=x)
        x *= np.float32(cap)
    return x


class NumpyOps:
    """The Ops protocol (model/ops/protocol.py) in NumPy: the oracle."""

    name = "numpy"
    xp = np
    storage_dtype = np.dtype(np.float32)
    kv_q8_0 = False  # K/V as q8_0 (model/kv_cache.py): the numba backend's, where asked
    asynchronous = False
    attention_cost = 1.0
    launcher = None

    def __init__(self):
        self.scratch_buffers: dict[str, np.ndarray] = {}

    def asarray(self, x, dtype=np.float32) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=dtype)

    def to_host(self, x) -> np.ndarray:
        return x

    def download(self, x) -> Download:
        return Download(x)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def weight(self, x) -> np.ndarray:
        """float32, a GGUF's blocks dequantized (per tensor)."""
        return self.asarray(float32(x))

    def moe(self, x: np.ndarray, experts: Experts, gelu: bool = False, router_x=None) -> np.ndarray:
        """The mixture of experts' output for tokens x: routed (model/ops/moe.py) on router_x
        (x where None), each expert's rows through its gate/up and down as one GEMM each (and
        their biases), summed per token; plus a shared expert's output, gated, where the layer
        has one."""
        logits = self.router_logits(x if router_x is None else router_x, experts.router)
        if experts.router_bias is not None:
            logits += experts.router_bias
        plan = route(logits, experts.top_k, experts.normalize, experts.expert_scale)
        gate_up = add_bias(self.grouped_linear(x[plan.tokens], experts.gate_up, plan), experts.gate_up_bias, plan)
        if experts.swiglu_clamp is not None:
            act = clamped_swiglu(gate_up, *experts.swiglu_clamp)
        else:
            act = self.gelu_and_mul(gate_up) if gelu else self.silu_and_mul(gate_up)
        out = combine(add_bias(self.grouped_linear(act, experts.down, plan), experts.down_bias, plan), plan)
        if experts.shared_gate is None:
            return out
        shared = self.linear(self.silu_and_mul(self.linear(x, experts.shared_gate_up)), experts.shared_down)
        return out + self.sigmoid_mul(shared, self.router_logits(x, experts.shared_gate))

    def router_logits(self, x: np.ndarray, router: np.ndarray) -> np.ndarray:
        return x @ router.T

    def grouped_linear(self, rows: np.ndarray, w, plan: ExpertPlan) -> np.ndarray:
        """rows @ w_e.T for each expert e's rows (plan.starts), w the experts' weights stacked
        along their rows: a GEMM per expert that has rows, never one per token."""
        n = w.shape[0] // plan.experts
        out = np.empty((rows.shape[0], n), dtype=np.float32)
        for e in plan.active:
            lo, hi = plan.starts[e], plan.starts[e + 1]
            out[lo:hi] = self.linear(rows[lo:hi], w[e * n:(e + 1) * n])
        return out

    def loaded(self) -> None:
        pass

    def embedding(self, table: np.ndarray, token_ids: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """The table's rows, times scale (Gemma's sqrt(hidden))."""
        rows = table[token_ids]
        if scale != 1.0:
            rows *= np.float32(scale)
        return rows

    def linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """x @ w.T (+ bias) for activations x (tokens, in) and a weight w (out, in)."""
        out = (w @ x.T).T if x.shape[0] <= SKINNY_ROWS else x @ w.T
        if bias is not None:
            out += bias
        return out

    def lora(self, y, x, a, b, slots, scales, first: int):
        """y[t, first:first + out] += scales[t] * b[s] @ (a[s] @ x[t]) for each token t with an
        adapter's slot s = slots[t] >= 0 (model/lora.py); y in place, a slot's tokens together."""
        out = b.shape[1]
        for s in np.unique(slots[slots >= 0]):
            rows = np.flatnonzero(slots == s)
            shrunk = (x[rows] @ a[s].T) * scales[rows, None]
            y[rows, first:first + out] += shrunk @ b[s].T
        return y

    def logits(self, h: np.ndarray, w: np.ndarray, softcap: float = 0.0, out=None) -> np.ndarray:
        """The LM head in float32; with a softcap (Gemma 2), cap * tanh(logits / cap)."""
        return into(out, soft_capped(self.linear(h, w), softcap))

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(np.square(x), axis=-1, keepdims=True)
        return x / np.sqrt(variance + np.float32(eps)) * weight

    def add_rms_norm(self, x: np.ndarray, delta: np.ndarray | None, weight: np.ndarray, eps: float):
        """The residual stream's step: x += delta (in place; none before the first layer), then
        (x, rms_norm(x))."""
        if delta is not None:
            x += delta
        return x, self.rms_norm(x, weight, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate halves (Hugging Face's layout): x is (tokens, heads, head_dim), cos/sin are
        (tokens, head_dim / 2)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def silu_and_mul(self, gate_up: np.ndarray) -> np.ndarray:
        half = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :half], gate_up[:, half:]
        out = np.negative(gate)  # in place from here: prefill makes these arrays megabytes big
        np.exp(out, out=out)
        out += np.float32(1.0)
        np.divide(gate, out, out=out)
        out *= up
        return out

    def scale_tokens(self, x: np.ndarray, factors: np.ndarray) -> np.ndarray:
        """Each token's (first axis) values times its factor."""
        return x * factors.reshape(-1, *(1,) * (x.ndim - 1))

    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """x times the logistic sigmoid of gate (a gated attention's output)."""
        return x / (np.float32(1.0) + np.exp(-gate))

    def gated_delta_net(self, proj, weights, shape, history, state, rows, eps: float) -> np.ndarray:
        return delta_rule.gated_delta_net(proj, weights, shape, history, state, rows, eps)

    def gelu_and_mul(self, gate_up: np.ndarray) -> np.ndarray:
        """GeGLU with GELU's tanh form (Gemma's gelu_pytorch_tanh)."""
        half = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :half], gate_up[:, half:]
        inner = np.float32(math.sqrt(2 / math.pi)) * (gate + np.float32(0.044715) * gate * gate * gate)
        return np.float32(0.5) * gate * (np.float32(1.0) + np.tanh(inner)) * up

    def write_kv(self, cache_k: np.ndarray, cache_v: np.ndarray, slots: np.ndarray,
                 k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V (tokens, kv_heads, head_dim) at flat slots of caches shaped
        (kv_heads, blocks, block_size, head_dim)."""
        heads, _, _, dim = cache_k.shape
        cache_k.reshape(heads, -1, dim)[:, slots] = k.transpose(1, 0, 2)
        cache_v.reshape(heads, -1, dim)[:, slots] = v.transpose(1, 0, 2)

    def rope_and_cache(self, qkv, cos, sin, cache_k, cache_v, slots, heads: int, q_norm=None, k_norm=None,
                       v_norm=None, eps: float = 0.0):
        """From fused QKV rows (tokens, width): q (heads x head_dim) first, k and v (kv_heads x
        head_dim each) last, a gate's rows between left alone. q and k rotated, k and v stored at
        slots (write_kv), the rotated q returned as (tokens, heads, head_dim). What the forward
        pass does between the QKV projection and attention, as one op so that a device can do
        it in one kernel (model/ops/cuda_ops.py). With q/k norms, q and k are RMS-normalised
        before the rotation over each stretch as long as their weights: a head, or the whole
        projection (OLMoE's); v over each head with v_norm (Gemma 4's)."""
        kv_heads, head_dim = cache_k.shape[0], cache_k.shape[-1] - (SCALE_BYTES if self.kv_q8_0 else 0)
        tokens, q_size, kv_size = qkv.shape[0], heads * head_dim, kv_heads * head_dim
        q, k, v = qkv[:, :q_size], qkv[:, -2 * kv_size:-kv_size], qkv[:, -kv_size:]
        if q_norm is not None:
            q = self.rms_norm(q.reshape(-1, q_norm.shape[0]), q_norm, eps)
            k = self.rms_norm(k.reshape(-1, k_norm.shape[0]), k_norm, eps)
        if v_norm is not None:
            v = self.rms_norm(v.reshape(-1, head_dim), v_norm, eps)
        q, k, v = (x.reshape(tokens, -1, head_dim) for x in (q, k, v))
        self.write_kv(cache_k, cache_v, slots, self.rope(k, cos, sin), v)
        return self.rope(q, cos, sin)

    def attention_meta(self, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int) -> list[AttentionChunk]:
        """Plan a step's attention once; every layer reuses it.

        Row r's queries are the last query_lens[r] tokens of its context_lens[r] tokens, whose K/V
        are already in the cache, so prefill chunks attend causally on top of a cached prefix.
        Rows are sorted by work and chunked so that padding stays small.
        """
        starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
        order = sorted(range(len(query_lens)), key=lambda r: (query_lens[r], context_lens[r]))
        groups, group = [], []
        for r in order:  # sorted, so the newest row is the chunk's longest
            if group and (len(group) == ATTENTION_CHUNK_ROWS
                          or query_lens[r] * context_lens[r]
                          > ATTENTION_CHUNK_SLACK * query_lens[group[0]] * context_lens[group[0]]):
                groups.append(group)
                group = []
            group.append(r)
        groups.append(group)
        chunks = []
        for rows in groups:
            n = np.array([query_lens[r] for r in rows])
            ctx = np.array([context_lens[r] for r in rows])
            max_q = int(n.max())
            max_blocks = -(-int(ctx.max()) // block_size)
            qi = np.arange(max_q)
            query_valid = qi[None, :] < n[:, None]
            query_index = np.where(query_valid, starts[rows][:, None] + qi[None, :], 0)
            key_blocks = np.zeros((len(rows), max_blocks), dtype=np.int64)
            for i, r in enumerate(rows):
                used = -(-int(ctx[i]) // block_size)
                key_blocks[i, :used] = block_tables[r][:used]
            key_pos = np.arange(max_blocks * block_size)
            query_pos = (ctx - n)[:, None] + qi[None, :]  # (rows, max_q)
            visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < ctx[:, None, None])
            bias = np.where(visible, np.float32(0), np.float32(-np.inf))
            chunks.append(AttentionChunk(query_index, query_valid, key_blocks, bias[None, :, None], query_pos))
        return chunks

    def paged_attention(self, q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                        meta: list[AttentionChunk], scale: float, window: int = 0,
                        softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        """q is (tokens, heads, head_dim); the caches are (kv_heads, blocks, block_size, head_dim),
        read only through the block ids in meta, a whole block per copy. Everything is laid out
        kv-head-major, so both batched matmuls see contiguous matrices. window: a sliding
        window's length (each query sees its last `window` positions; 0: all); softcap: Gemma 2's
        scores = cap * tanh(scores / cap), 0 for none; sinks: GPT-OSS's, a logit per head in the
        softmax's sum."""
        tokens, heads, dim = q.shape
        kv_heads, _, block_size, _ = cache_k.shape
        group = heads // kv_heads
        out = np.empty((tokens, heads * dim), dtype=np.float32)
        for c in meta:
            rows, max_q = c.query_index.shape
            ctx = c.key_blocks.shape[1] * block_size
            qc = np.take(q, c.query_index, axis=0).reshape(rows, max_q, kv_heads, group, dim)
            qc = qc.transpose(2, 0, 3, 1, 4).reshape(kv_heads, rows, group * max_q, dim) * np.float32(scale)
            gathered = (kv_heads, rows, c.key_blocks.shape[1], block_size, dim)
            k = np.take(cache_k, c.key_blocks, axis=1, out=self.scratch("k", gathered), mode="clip")
            v = np.take(cache_v, c.key_blocks, axis=1, out=self.scratch("v", gathered), mode="clip")
            k = k.reshape(kv_heads, rows, ctx, dim)
            v = v.reshape(kv_heads, rows, ctx, dim)
            scores = np.matmul(qc, k.transpose(0, 1, 3, 2),
                               out=self.scratch("s", (kv_heads, rows, group * max_q, ctx)))
            scores = soft_capped(scores.reshape(kv_heads, rows, group, max_q, ctx), softcap)
            scores += c.bias_for(window)
            top = scores.max(axis=-1, keepdims=True)
            if sinks is not None:  # a logit that takes a share of the sum and adds no value
                sink = sinks.reshape(kv_heads, 1, group, 1, 1)
                top = np.maximum(top, sink)
            scores -= top
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
            scores /= total if sinks is None else total + np.exp(sink - top)
            o = scores.reshape(kv_heads, rows, group * max_q, ctx) @ v
            o = o.reshape(kv_heads, rows, group, max_q, dim).transpose(1, 3, 0, 2, 4)
            o = o.reshape(rows, max_q, heads * dim)
            out[c.query_index[c.query_valid]] = o[c.query_valid]
        return out

    def scratch(self, name: str, shape: tuple) -> np.ndarray:
        """A reused float32 buffer: fresh multi-megabyte temporaries in the per-layer loop cost up to
        2x through page faults. Safe because one step runs at a time."""
        size = int(np.prod(shape))
        buf = self.scratch_buffers.get(name)
        if buf is None or buf.size < size:
            buf = self.scratch_buffers[name] = np.empty(size, dtype=np.float32)
        return buf[:size].reshape(shape)

    def sample(self, logits: np.ndarray, batch: SampleBatch) -> SampleResult:
        """One token per row of logits (rows, vocab). This backend keeps nothing per request
        (batch.keys): it reads each row's history every step."""
        return sample_rows(logits, batch)

    def score(self, logits: np.ndarray, token_ids, top: int) -> Scored:
        """Each row's given token: its logprob and rank under the raw logits, and the row's top."""
        lsm = log_softmax(logits)
        chosen = lsm[np.arange(len(lsm)), np.asarray(token_ids, dtype=np.int64)]
        ranks = 1 + (lsm > chosen[:, None]).sum(axis=1)
        return Scored([float(x) for x in chosen], [int(x) for x in ranks], [most_likely(row, top) for row in lsm])

    def release(self, key) -> None:
        """A request has ended; this sampler keeps nothing per request."""
