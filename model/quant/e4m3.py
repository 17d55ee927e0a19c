"""The e4m3 blocks an FP8 checkpoint's weights are repacked into at load (model/quant/fp8.py),
read back: their fields and values, for the backends that take float32 (NumPy) and for the tests.
Apart from fp8.py so that model/quant/quantized.py's dequantize reads them without importing the
loader.

A block (kind fp8_128 where the row is whole 128s and every 128 inputs share one scale, else
fp8_32): its float32 scale, then VALUES e4m3 codes in the checkpoint's order: 132 bytes a 128
(8.25 bits a weight), 36 a 32 (9). A per-tensor or per-row scale is repeated in each block, a
[bo, bi] block's scale put on each of its blocks (bi a multiple of 32). The scale stays float32 so
that a weight decodes as fp8.py's float32 dequantization computes it, bit for bit: the e4m3 value
(exact in float32) times the scale, one float32 product. cuda/dequant_gemv.cu's FP8_32 and
FP8_128 decode them on the GPU (W8A16, as vLLM's FP8 Marlin kernels where no FP8 tensor cores are).
"""

import numpy as np

KINDS = {"fp8_32": 32, "fp8_128": 128}  # kind -> values a block
HEAD = 4  # bytes before a block's codes: its float32 scale


def e4m3_values() -> np.ndarray:
    """float32 of each of the 256 e4m3 codes (sign, 4 exponent bits of bias 7, 3 mantissa bits;
    S.1111.111 is NaN, no infinities)."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = (sign * magnitude).astype(np.float32)
    values[(exponent == 15) & (mantissa == 7)] = np.nan
    return values


E4M3 = e4m3_values()


def block_bytes(kind: str) -> int:
    return HEAD + KINDS[kind]


def kind_for(columns: int, scale_columns: int | None) -> str | None:
    """The blocks a weight of `columns` inputs takes whose scales change every scale_columns
    inputs (None: per tensor or row); None where no block of 32 has one scale."""
    if columns % 32 or (scale_columns or 32) % 32:
        return None
    return "fp8_128" if columns % 128 == 0 and (scale_columns or 128) % 128 == 0 else "fp8_32"


def to_blocks(kind: str, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The block rows (rows, row bytes) of codes (rows, columns) uint8, each block's scale in
    scales (rows, columns / VALUES)."""
    rows = codes.shape[0]
    head = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint8).reshape(rows, -1, HEAD)
    return np.concatenate([head, codes.reshape(rows, -1, KINDS[kind])], axis=-1).reshape(rows, -1)


def fields(t) -> tuple[np.ndarray, np.ndarray]:
    """(scales float32 (rows, blocks), codes uint8 (rows, columns))."""
    blocks = t.blocks.reshape(t.shape[0], -1, block_bytes(t.kind))
    return np.ascontiguousarray(blocks[..., :HEAD]).view(np.float32)[..., 0], blocks[..., HEAD:].reshape(t.shape)


def dequantize(t) -> np.ndarray:
    """float32 e4m3 value x scale: fp8.py's values, exactly."""
    scales, codes = fields(t)
    values = E4M3[codes].reshape(t.shape[0], -1, KINDS[t.kind])
    return (values * scales[..., None]).reshape(t.shape)
