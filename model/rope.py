"""Rotary position tables as Hugging Face defines them: the plain rotation, the scalings
checkpoints name (linear, llama3, yarn, longrope, proportional), partial rotation, and layers
that do not rotate.

Every backend rotates (x1, x2) halves by a (positions, head_dim / 2) table of cos and sin, so a
scaling is only a different table: its frequencies, times the attention factor YaRN and
LongRoPE multiply into cos and sin. A partial rotation (Phi-4-mini rotates 3/4 of each head) is
the same table with cos 1 and sin 0 past the rotated pairs, once the q/k rows of each head are
reordered at load (rotary_row_order) so that Hugging Face's pairs (j, j + rotary_dim / 2) sit at
(j, j + head_dim / 2); q.k is the same under any order both share.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def scaling_kind(scaling: dict | None) -> str:
    """The scaling's type, under the name Hugging Face uses now ("su" was LongRoPE's first name)."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if kind == "su" else kind


def llama3_divisors(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> np.ndarray:
    """Llama 3's per-frequency divisors (what llama.cpp stores as rope_freqs): long wavelengths
    divided by factor, short ones kept, a smooth blend between."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _yarn(base_freq: np.ndarray, dim: int, theta: float, s: dict) -> tuple[np.ndarray, float]:
    original = int(s["original_max_position_embeddings"])
    factor = float(s["factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: the frequency extrapolates unchanged; 0: it is interpolated by factor
    return base_freq / factor * (1 - keep) + base_freq * keep, float(attention)


def _longrope(dim: int, theta: float, s: dict, max_positions: int) -> tuple[np.ndarray, float]:
    original = int(s["original_max_position_embeddings"])
    factor = float(s["factor"])
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    # The long factors once the served context passes the trained one, as llama.cpp chooses:
    # fixed for the server's life, so cached keys and every batch agree (Hugging Face switches
    # per call, vLLM per batch).
    ext = np.asarray(s["long_factor"] if max_positions > original else s["short_factor"], dtype=np.float64)
    if ext.shape != (dim // 2,):
        from model.errors import ModelError

        raise ModelError(f"rope_scaling's LongRoPE factors have {ext.size} entries, the rotary dim"
                         f" {dim} needs {dim // 2}; the config.json is inconsistent")
    return 1.0 / (ext * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)), float(attention)


def rotary_dim(config, head_dim: int | None = None) -> int:
    """The dims each head (of head_dim, config's where None) rotates in pairs (j, j + rotary_dim
    / 2): all of them in a proportional rotation (Gemma 4's), whose pairs past its share stand
    still."""
    head_dim = head_dim or config.head_dim
    if scaling_kind(config.rope_scaling) == "proportional":
        return head_dim
    return int(head_dim * config.partial_rotary_factor)


def frequencies(config, max_positions: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies of the rotated pairs, the factor cos and sin are multiplied by)."""
    dim, theta, s = rotary_dim(config), config.rope_theta, config.rope_scaling or {}
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = scaling_kind(s)
    if kind == "proportional":  # the first share of the pairs at head_dim's frequencies, the rest still
        pairs = int(config.partial_rotary_factor * dim // 2)
        return inv_freq[:pairs] / float(s.get("factor", 1.0)), 1.0
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        return inv_freq / llama3_divisors(inv_freq, float(s["factor"]), float(s.get("low_freq_factor", 1.0)),
                                          float(s.get("high_freq_factor", 4.0)),
                                          int(s["original_max_position_embeddings"])), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, dim, theta, s)
    if kind == "longrope":
        return _longrope(dim, theta, s, max_positions)
    return inv_freq, 1.0


def rope_tables(config, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (max_positions, head_dim / 2) float64: row p rotates position p."""
    inv_freq, attention = frequencies(config, max_positions)
    freq = np.zeros(config.head_dim // 2)
    freq[:inv_freq.size] = inv_freq
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * freq[None, :]
    scale = np.where(np.arange(freq.size) < inv_freq.size, attention, 1.0)
    return np.cos(angles) * scale, np.sin(angles) * scale


def rotary_row_order(head_dim: int, rotary: int) -> np.ndarray | None:
    """Within a head: row i of the reordered q/k is row order[i] of Hugging Face's, so that its
    rotated pairs (j, j + rotary / 2) become (j, j + head_dim / 2). None for a full rotation."""
    if rotary == head_dim:
        return None
    half, rest = rotary // 2, (head_dim - rotary) // 2
    return np.concatenate([np.arange(half), rotary + np.arange(rest),
                           half + np.arange(half), rotary + rest + np.arange(rest)])
