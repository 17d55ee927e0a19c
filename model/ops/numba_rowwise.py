"""The one-pass numba kernels of the residual stream: residual add with RMSNorm, RMSNorm,
rotary, SiLU- and GELU-and-mul and the K/V write, each in place where NumPy makes temporaries.

The K/V write rounds to float16 bits where the cache holds them (model/ops/numba_kernels.HALF;
QUANTIZED_KV says where), or to q8_0 where it is int8 (--cache-type-k q8_0, model/kv_cache.py).
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import intrinsic

from model.ops.numba_kernels import FASTMATH, F1, F2, F3, F4, H4, I1, exp_shifted, kernel
from model.ops.protocol import SCALE_BYTES


@intrinsic
def _as_cached(typingctx, x, cache):
    """float32 x as the cache holds it: as it is, or the bits of the nearest float16 (vcvtps2ph
    when vectorised). Typed by the cache, so a float32 kernel holds no float16 conversion (which
    a target without F16C cannot link)."""
    half = cache.dtype == nbtypes.uint16

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16)) if half else args[0]
    return (nbtypes.uint16 if half else nbtypes.float32)(x, cache), codegen


KV = "float32[:, :, :]"  # (tokens, kv_heads, head_dim) K or V, any strides (v is a view of qkv)
B1 = "int8[::1]"  # a q8_0 cache, flat


@kernel(f"void({F4}, {F4}, {I1}, {KV}, {KV})", f"void({H4}, {H4}, {I1}, {KV}, {KV})")
def _write_kv(cache_k, cache_v, slots, k, v):
    tokens, heads, dim = k.shape
    block_size = cache_k.shape[2]
    for job in prange(tokens * heads):
        t, h = job // heads, job % heads
        block, i = slots[t] // block_size, slots[t] % block_size
        for d in range(dim):
            at = d * block_size + i  # K's place in its block, head-dim-major
            cache_k[h, block, at // dim, at % dim] = _as_cached(k[t, h, d], cache_k)
            cache_v[h, block, i, d] = _as_cached(v[t, h, d], cache_v)


@njit(inline="always", fastmath=FASTMATH)
def _quantized(x, cache, at, step, scales, scale_at):
    """x as q8_0: cache[at + d * step] = round(x[d] / s), s = max |x| / 127, and scales[scale_at] = s."""
    top = np.float32(0.0)
    for d in range(x.shape[0]):
        top = max(top, abs(x[d]))
    s = top / np.float32(127.0)
    scales[scale_at] = s
    for d in range(x.shape[0]):
        cache[at + d * step] = np.int8(np.rint(x[d] / s)) if s > 0 else np.int8(0)


@kernel(f"void({B1}, {F1}, {B1}, {F1}, {I1}, int64, {KV}, {KV})")
def _write_kv_q8_0(cache_k, k_scales, cache_v, v_scales, slots, block_size, k, v):
    """Each token's K and V head vectors as q8_0 into the flat caches (k_scales and v_scales: the
    same memory seen as float32): keys head-dim-major with the block's keys' scales after them,
    V rows each followed by its scale."""
    tokens, heads, dim = k.shape
    width = dim + SCALE_BYTES
    blocks = cache_k.shape[0] // (heads * block_size * width)
    for job in prange(tokens * heads):
        t, h = job // heads, job % heads
        block, i = slots[t] // block_size, slots[t] % block_size
        base = (h * blocks + block) * block_size * width
        _quantized(k[t, h], cache_k, base + i, block_size, k_scales, (base + dim * block_size) // 4 + i)
        _quantized(v[t, h], cache_v, base + i * width, 1, v_scales, (base + i * width + dim) // 4)


def write_kv(cache_k: np.ndarray, cache_v: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """K/V (tokens, kv_heads, head_dim) into the caches' flat slots, as float16 bits or q8_0
    where the caches hold them. A K block's elements are head-dim-major (model/ops/numba_attention.py
    reads a block's keys side by side, one vector a dimension): key i's dimension d is at flat
    offset d * block_size + i of its block (a q8_0 block's keys' scales after them, float32 at
    offset head_dim * block_size + 4 i). V blocks are as NumpyOps keeps them (a q8_0 row's scale
    after its values)."""
    slots = np.asarray(slots, dtype=np.int64)
    if cache_k.dtype != np.int8:
        _write_kv(k.size, cache_k, cache_v, slots, k, v)
        return
    flat_k, flat_v = cache_k.reshape(-1), cache_v.reshape(-1)
    _write_kv_q8_0(k.size, flat_k, flat_k.view(np.float32), flat_v, flat_v.view(np.float32), slots,
                   cache_k.shape[2], k, v)


@kernel(f"void({F2}, {F2}, {F1}, float32, {F2})")
def _add_rms_norm(x, delta, gamma, eps, out):
    tokens, hidden = x.shape
    for t in prange(tokens):
        total = np.float32(0.0)
        for i in range(hidden):
            v = x[t, i] + delta[t, i]
            x[t, i] = v
            total += v * v
        inv = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = x[t, i] * inv * gamma[i]


@kernel(f"void({F2}, {F1}, float32, {F2})")
def _rms_norm(x, gamma, eps, out):
    rows, dim = x.shape
    for t in prange(rows):
        total = np.float32(0.0)
        for i in range(dim):
            total += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.sqrt(total / np.float32(dim) + np.float32(eps))
        for i in range(dim):
            out[t, i] = x[t, i] * inv * gamma[i]


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _rms_norm(flat.size, flat, gamma, np.float32(eps), out)
    return out.reshape(x.shape)


def add_rms_norm(x: np.ndarray, delta: np.ndarray | None, gamma: np.ndarray, eps: float):
    """x += delta in place (none before the first layer), then (x, rms_norm(x)), in one pass."""
    if delta is None:
        return x, rms_norm(x, gamma, eps)
    out = np.empty_like(x)
    _add_rms_norm(x.size, x, np.ascontiguousarray(delta), gamma, np.float32(eps), out)
    return x, out


@kernel(f"void({F3}, {F2}, {F2}, {F3})")
def _rope(x, cos, sin, out):
    tokens, heads, dim = x.shape
    half = dim // 2
    for t in prange(tokens):
        for h in range(heads):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, half + i]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, half + i] = b * cos[t, i] + a * sin[t, i]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, dtype=np.float32)
    _rope(x.size, np.ascontiguousarray(x), np.ascontiguousarray(cos, dtype=np.float32),
          np.ascontiguousarray(sin, dtype=np.float32), out)
    return out


@kernel(f"void({F2}, {F2}, boolean)")
def _gated(gate_up, out, gelu):
    """out = act(gate) * up, act(g) = g / (1 + exp(-z)): z = g for SiLU, z = 2 * inner for
    GELU's tanh form (0.5 * g * (1 + tanh(inner)) = g * sigmoid(2 * inner)), with the exp that
    vectorises (np.exp and np.tanh do not)."""
    tokens, width = out.shape
    for t in prange(tokens):
        row = out[t]
        powers = np.empty(width, dtype=np.int32)
        for i in range(width):
            g = gate_up[t, i]
            row[i] = np.float32(-1.5957691216057308) * (g + np.float32(0.044715) * g * g * g) if gelu else -g
        exp_shifted(row, np.float32(0.0), width, powers)
        for i in range(width):
            row[i] = gate_up[t, i] / (np.float32(1.0) + row[i]) * gate_up[t, width + i]


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    _gated(out.size, np.ascontiguousarray(gate_up), out, False)
    return out


def gelu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """GeGLU with GELU's tanh form (Gemma's gelu_pytorch_tanh)."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    _gated(out.size, np.ascontiguousarray(gate_up), out, True)
    return out
