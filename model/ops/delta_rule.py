"""The linear-attention layers of hybrid models (Qwen3.5, Qwen3-Next), in float32 NumPy: the
reference the CPU and CUDA kernels are held to.

A gated delta-net layer keeps, per request, a fixed-size state instead of K/V: a (k_dim, v_dim)
matrix per value head, and the last kernel-1 inputs of its short causal convolution. Both are
updated one token at a time here (the recurrent form): a prompt fed whole or in chunks of any
size goes through the same float operations in the same order, so its state and outputs keep
their bits however the scheduler splits it. The chunked (WY) form that GPU prefill kernels use
is the same sum regrouped, with different rounding.
"""

import numpy as np

from model.families.family import DeltaNet


def causal_conv(x: np.ndarray, history: np.ndarray, weight: np.ndarray, bias: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution and SiLU over one request's new tokens.

    x: (tokens, channels); history: (kernel - 1, channels), the inputs before x (zeros at a
    prompt's start); weight: (channels, kernel), oldest tap first. Returns (the outputs,
    (tokens, channels); the history after x)."""
    kernel = weight.shape[1]
    padded = np.concatenate([history, x]).astype(np.float32)
    out = np.zeros(x.shape, dtype=np.float32)
    for tap in range(kernel):
        out += padded[tap:tap + len(x)] * weight[:, tap]
    if bias is not None:
        out += bias
    return silu(out), padded[len(padded) - (kernel - 1):].copy()


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule over one request's new tokens, token by token.

    q, k: (tokens, heads, k_dim), already L2-normalised (q also scaled); v: (tokens, heads,
    v_dim); g: (tokens, heads), the log of each token's decay; beta: (tokens, heads), its write
    strength; state: (heads, k_dim, v_dim). For each token: the state decays by exp(g), the
    value it holds for k is moved toward v by beta (S += k (beta (v - S^T k))^T), and the output
    is S^T q. Returns (the outputs, (tokens, heads, v_dim); the state after the last token)."""
    state = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(len(q)):
        state *= np.exp(g[t])[:, None, None]
        held = np.einsum("hkv,hk->hv", state, k[t])
        state += k[t][:, :, None] * (beta[t][:, None] * (v[t] - held))[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out, state


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x over its last axis divided by its length (eps inside the square root, as the models
    were trained)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of x (over its last axis) times weight, times SiLU of gate: a delta-net layer's
    output norm, gated by its z projection."""
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (normed * weight) * silu(gate)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), without overflow for large x."""
    return np.logaddexp(np.float32(0.0), x).astype(np.float32)


def convolve_rows(x: np.ndarray, history: np.ndarray, weight: np.ndarray, rows) -> np.ndarray:
    """causal_conv over each row of a step (kv_cache.StateRows), each carrying its slot's history."""
    out = np.empty(x.shape, dtype=np.float32)
    for start, count, slot in zip(rows.starts, rows.counts, rows.slots):
        out[start:start + count], history[slot] = causal_conv(x[start:start + count], history[slot], weight, None)
    return out


def delta_rule_rows(q, k, v, g, beta, state: np.ndarray, rows) -> np.ndarray:
    """gated_delta_rule over each row of a step, each from and into its slot's state."""
    out = np.empty(v.shape, dtype=np.float32)
    for start, count, slot in zip(rows.starts, rows.counts, rows.slots):
        span = slice(start, start + count)
        out[span], state[slot] = gated_delta_rule(q[span], k[span], v[span], g[span], beta[span], state[slot])
    return out


def gated_delta_net(proj: np.ndarray, w, shape: DeltaNet, history: np.ndarray, state: np.ndarray, rows, eps: float,
                    convolve=convolve_rows, recur=delta_rule_rows) -> np.ndarray:
    """A delta-net layer between its two projections: proj, (tokens, shape.projections), is the
    fused input projection of a step's tokens (q, k, v, z, b, a); w, its model.weights.
    DeltaNetWeights; history and state, the layer's slots (updated in place, a fresh row's zeroed
    first). Returns the gated, normalised output (tokens, values), for out_proj. convolve and
    recur are the two steps that carry state; a backend passes its kernels for them."""
    fresh = rows.slots[rows.fresh]
    history[fresh], state[fresh] = 0.0, 0.0
    tokens, n = len(proj), shape.conv_channels
    mixed = convolve(proj[:, :n], history, w.conv, rows)
    q = l2_normalize(mixed[:, :shape.keys].reshape(tokens, shape.key_heads, shape.key_dim))
    k = l2_normalize(mixed[:, shape.keys:2 * shape.keys].reshape(tokens, shape.key_heads, shape.key_dim))
    q = q * np.float32(shape.key_dim ** -0.5)
    if shape.value_heads != shape.key_heads:  # each key head read by value_heads / key_heads value heads
        repeat = shape.value_heads // shape.key_heads
        if shape.tiled:  # value head j reads key head j % key_heads
            q, k = np.tile(q, (1, repeat, 1)), np.tile(k, (1, repeat, 1))
        else:  # j // repeat
            q, k = np.repeat(q, repeat, axis=1), np.repeat(k, repeat, axis=1)
    v = mixed[:, 2 * shape.keys:].reshape(tokens, shape.value_heads, shape.value_dim)
    z = proj[:, n:n + shape.values].reshape(tokens, shape.value_heads, shape.value_dim)
    gates = n + shape.values  # b, then a, one per value head
    b, a = proj[:, gates:gates + shape.value_heads], proj[:, gates + shape.value_heads:]
    beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-b))
    g = w.decay * softplus(a + w.dt_bias)
    out = recur(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), g, beta, state, rows)
    return gated_rms_norm(out, z, w.norm, eps).reshape(tokens, shape.values)
