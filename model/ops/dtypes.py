"""The storage types of the CUDA path, on any array module (NumPy or CuPy).

Neither NumPy nor CuPy has a bfloat16 dtype, so bfloat16 arrays are uint16 bit patterns. The
conversions below are elementwise array code, so on a GPU they run on the device: weights go
up in float32 once and are rounded there, with the same round-to-nearest-even as CUDA's
__float2bfloat16_rn.
"""

import numpy as np

# The dtype names --dtype takes -> the array dtype that holds them.
ARRAY_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}


def dtype_name(array_dtype) -> str:
    """The storage type an array holds, from its dtype (uint16 means bfloat16 here)."""
    return {"float32": "float32", "float16": "float16", "uint16": "bfloat16"}[np.dtype(array_dtype).name]


def to_bf16(x, xp=np):
    """float32 -> bfloat16 bits (uint16), rounding to nearest even; NaN stays NaN."""
    u = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return xp.where(xp.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_storage(x, dtype: str, xp=np):
    """A float array in a storage type: float32, float16, or bfloat16 as uint16 bits."""
    if dtype == "bfloat16":
        return to_bf16(x, xp)
    return xp.ascontiguousarray(x, dtype=ARRAY_DTYPES[dtype])


def to_float32(x, dtype: str):
    return from_bf16(x) if dtype == "bfloat16" else x.astype(np.float32)
