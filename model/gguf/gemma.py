"""A Gemma GGUF's switches: what llama.cpp reads from the metadata, and what it infers."""

import numpy as np

from model.errors import ModelError


def gemma_switches(field, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma's switches as llama.cpp reads or infers them (src/models/gemma2.cpp, gemma3.cpp);
    field(key, default=None): the metadata value."""
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    window = int(field(k("attention.sliding_window"), 4096 if arch == "gemma2" else 0) or 0)
    windows = None
    if window:
        pattern = field(k("attention.sliding_window_pattern"), 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):  # one flag a layer
            windows = tuple(window if flag else 0 for flag in pattern)
        else:  # every pattern-th layer global
            windows = tuple(window if (i + 1) % int(pattern) else 0 for i in range(layers))
        if len(windows) != layers:
            raise ModelError(f"{arch}.attention.sliding_window_pattern has {len(windows)} flags for {layers} layers")
    big = layers == (46 if arch == "gemma2" else 62)  # the 27B: scaled by hidden / heads, not head_dim
    local = field(k("rope.freq_base_swa"))
    return {
        "layer_windows": windows,
        "local_rope_theta": None if arch == "gemma2" else float(str(np.float32(local if local else 10000.0))),
        "query_scale": float((hidden // heads if big else head_dim) ** -0.5),
        "attn_softcap": float(field(k("attn_logit_softcapping"), 0.0) or 0.0) if arch == "gemma2" else 0.0,
        "final_softcap": float(field(k("final_logit_softcapping"), 0.0) or 0.0),
        "gelu": True,
    }
