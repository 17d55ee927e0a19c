"""The int4 blocks an AWQ or GPTQ checkpoint's layers are repacked into at load
(model/quant/awq_gptq.py, whose docstring gives the layout), read back: their fields and their
values, for the backends that take float32 (NumPy) and for the tests. Apart from awq_gptq.py so
that model/quant/quantized.py's dequantize reads them without importing the loader."""

import numpy as np

KINDS = {"int4_32": 32, "int4_128": 128}  # kind -> values a block
HEAD = 4  # bytes before a block's codes: scale and zero, float16 each


def block_bytes(kind: str) -> int:
    return HEAD + KINDS[kind] // 2


def fields(t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales float16 (rows, blocks), zeros float16 (rows, blocks), codes uint8 (rows, columns))."""
    values = KINDS[t.kind]
    blocks = t.blocks.reshape(t.shape[0], -1, HEAD + values // 2)
    head = np.ascontiguousarray(blocks[..., :HEAD]).view(np.float16)
    body = blocks[..., HEAD:]
    codes = np.concatenate([body & 15, body >> 4], axis=-1).reshape(t.shape)
    return head[..., 0], head[..., 1], codes


def dequantize(t) -> np.ndarray:
    """float32 scale x (code - zero): the format's values, exactly."""
    scales, zeros, codes = fields(t)
    values = KINDS[t.kind]
    levels = codes.reshape(t.shape[0], -1, values).astype(np.float32) - zeros[..., None].astype(np.float32)
    return (levels * scales[..., None].astype(np.float32)).reshape(t.shape)
