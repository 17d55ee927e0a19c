"""A dense, unbatched forward pass written straight from the Llama equations: no paging, no
fusing, a loop over heads. The tests hold the real forward pass against it."""

import numpy as np

from model.rope import frequencies


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate(x, positions, inv_freq):
    ang = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense_logits(config, t: dict, ids) -> np.ndarray:
    """Logits (len(ids), vocab) in float64, from raw Hugging Face tensors t."""
    c = config
    t = {k: v.astype(np.float64) for k, v in t.items()}
    pos = np.arange(len(ids), dtype=np.float64)
    inv_freq, _ = frequencies(c, len(ids))
    x = t["model.embed_tokens.weight"][ids]
    n = len(ids)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"], c.rms_norm_eps)
        proj = {}
        for name in "qkv":
            y = h @ t[p + f"self_attn.{name}_proj.weight"].T
            if p + f"self_attn.{name}_proj.bias" in t:
                y = y + t[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(n, -1, c.head_dim)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if p + "self_attn.q_norm.weight" in t:
            q = rms(q, t[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms(k, t[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = rotate(q, pos, inv_freq), rotate(k, pos, inv_freq)
        group = c.num_heads // c.num_kv_heads
        out = np.zeros((n, c.num_heads, c.head_dim))
        causal = np.tril(np.ones((n, n), dtype=bool))
        for head in range(c.num_heads):
            s = q[:, head] @ k[:, head // group].T / np.sqrt(c.head_dim)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, head] = s @ v[:, head // group]
        x = x + out.reshape(n, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        up = h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rms(x, t["model.norm.weight"], c.rms_norm_eps) @ head.T


def int8_activations(x: np.ndarray, top: int = 127) -> np.ndarray:
    """x as the integer GEMV (model/quant/gemv.py) rounds it: each block of 32 to int8 under one
    scale (its largest magnitude over 127; int16 with top 32767), in float64, so that x8 @ w.T
    is the kernel's result up to float rounding."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(top)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    return (np.rint(blocks * inverse).astype(np.float64) * scale).reshape(x.shape)
