"""A GGUF's rope scaling as Hugging Face's config.json states it: linear and YaRN from the
metadata, LongRoPE from the rope_factors tensors Phi-3 files carry, Llama 3's from the
rope_freqs tensor by matching the factors it would have (or, where it holds 1 for a share of the
pairs and 1e30 for the rest, Gemma 4's proportional rotation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from model.errors import ModelError
from model.rope import llama3_divisors


def rope_scaling(field: Callable[[str], Any], tensors: dict, head_dim: int, theta: float,
                 path: Path, context: int) -> dict | None:
    """field(name): the metadata value {architecture}.rope.{name}, or None; tensors: the file's
    tensors by name; head_dim: the rotated dims of a head; context: the trained context now."""
    kind = field("scaling.type")
    factor = field("scaling.factor")
    scaling = None
    if kind is None:
        # Older GGUFs wrote only a factor, or the even older rope.scale_linear key.
        legacy = field("scale_linear")
        if factor not in (None, 0.0, 1.0):
            kind = "linear"
        elif legacy not in (None, 0.0, 1.0):
            kind, factor = "linear", legacy
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        orig = field("scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        for key, hf in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                        ("yarn_beta_slow", "beta_slow")):
            v = field(f"scaling.{key}")
            if v:
                scaling[hf] = float(v)
        log_mul = field("scaling.yarn_log_multiplier")  # mscale_all_dim, mscale taken as 1 (llama.cpp's reading)
        if log_mul:
            scaling.update(mscale=1.0, mscale_all_dim=float(log_mul))
    elif kind not in (None, "none"):
        raise ModelError(
            f"{path.name} uses rope scaling {kind!r}, which this GGUF converter does not support;"
            " use the Hugging Face model directory instead"
        )
    if any(n in tensors for n in ("rope_factors_long.weight", "rope_factors_short.weight")):
        return _longrope(field, tensors, head_dim, path, context)
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ModelError(f"{path.name} has both rope scaling {kind!r} and a rope_freqs tensor; the file is inconsistent")
        import gguf

        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()
        turning = int(np.sum(freqs == 1.0))
        if freqs.size == head_dim // 2 and turning < freqs.size and np.all(freqs[turning:] >= 1e29) and \
                np.all(freqs[:turning] == 1.0):  # llama.cpp's proportional rotation: the pairs past a share still
            return {"rope_type": "proportional", "partial_rotary_factor": 2 * turning / head_dim}
        scaling = _match_llama3_rope(freqs, head_dim, theta)
        if scaling is None:
            raise ModelError(
                f"{path.name} has a rope_freqs tensor that matches no Llama 3 rope scaling this"
                " converter knows; use the Hugging Face model directory instead"
            )
    return scaling


def _longrope(field, tensors: dict, head_dim: int, path: Path, context: int) -> dict:
    import gguf

    factors = {}
    for which in ("long", "short"):
        t = tensors.get(f"rope_factors_{which}.weight")
        if t is None:
            raise ModelError(f"{path.name} has one of the two LongRoPE factor tensors only; the file is inconsistent")
        factors[which] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()
        if factors[which].shape != (head_dim // 2,):
            raise ModelError(f"{path.name}'s rope_factors_{which} has {factors[which].size} entries for"
                             f" {head_dim // 2} rotated pairs; the file is inconsistent")
    original = int(field("scaling.original_context_length") or context)
    scaling = {"rope_type": "longrope", "long_factor": [float(str(np.float32(f))) for f in factors["long"]],
               "short_factor": [float(str(np.float32(f))) for f in factors["short"]],
               "original_max_position_embeddings": original, "factor": context / original}
    if field("scaling.attn_factor"):
        scaling["attention_factor"] = float(field("scaling.attn_factor"))
    return scaling


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's rope scaling: what llama.cpp stores as rope_freqs."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return llama3_divisors(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)


def _match_llama3_rope(freqs: np.ndarray, head_dim: int, theta: float) -> dict | None:
    if freqs.shape != (head_dim // 2,):
        return None
    # The parameters every published Llama 3.x checkpoint uses; the factor varies.
    factor = float(freqs.max())
    for orig in (8192, 4096, 16384, 2048):
        for low, high in ((1.0, 4.0),):
            want = llama3_rope_factors(head_dim, theta, factor, low, high, orig)
            if np.allclose(want, freqs, rtol=1e-3, atol=1e-4):
                return {
                    "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig,
                }
    return None
