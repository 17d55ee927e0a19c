"""A GGUF's quantized tensors (model/quant/quantized.py) packed straight into the CPU backend's
strips: PACKERS, by GGUF type, read the blocks themselves, so nothing passes through float32 and
each kept value is the file's own, bit for bit (Strips.dequantize equals gguf's dequantize).
A kind without a packer here is dequantized and rounded to Q8_0 instead (to_q8_0). An FP8
checkpoint's e4m3 blocks are packed from their float32 values, as float weights are (pack_fp8).
"""

from typing import Callable

import numpy as np
from numba import njit, prange

from model.quant import awq_gptq, e4m3, kblocks, pack
from model.quant.quantized import FloatRows, QuantizedTensor, dequantize
from model.quant.strips import BLOCK, STRIP, IQ4_NLStrips, MXFP4Strips, Q4_1Strips, Q8_0Strips, Strips


def from_gguf(t: QuantizedTensor) -> Strips | None:
    """t's blocks packed into strips, or None where its kind has no packer (or its packer none
    for these blocks)."""
    packer = PACKERS.get(t.kind)
    return None if packer is None else packer(t.blocks, t.shape[1])


def to_q8_0(t: QuantizedTensor) -> Q8_0Strips:
    """For a kind with no packer here: t's values rounded to Q8_0 (pack.quantize) a slab of
    rows at a time, so that no float32 copy of a large tensor exists (a 128k-token embedding's
    is 1 GB)."""
    return pack.in_slabs(float_rows(t), pack.quantize)


def float_rows(t: QuantizedTensor) -> FloatRows:
    """t's values, dequantized a slab of rows at a time as they are read."""
    def read_into(first: int, out: np.ndarray) -> None:
        out[:] = dequantize(QuantizedTensor(t.kind, t.blocks[first:first + len(out)], out.shape))

    return FloatRows(t.shape, read_into)


def stacked(parts: tuple) -> Strips | None:
    """Packed parts of one GEMM as one weight, where they came out in one scheme (as parts of
    different GGUF types rounded to Q8_0 do) and every part but the last fills whole strips;
    None otherwise (their rows would straddle a strip)."""
    scheme = type(parts[0])
    if any(type(p) is not scheme for p in parts) or any(p.rows % STRIP for p in parts[:-1]):
        return None
    return scheme(np.concatenate([p.q for p in parts]), np.concatenate([p.factors for p in parts]),
                  sum(p.rows for p in parts))


# --- packers: (blocks (rows, row_bytes) uint8, columns) -> strips ---------------------------------

_Q8_0_BYTES = 2 + BLOCK  # float16 scale, 32 int8 values
_Q4_0_BYTES = 2 + BLOCK // 2  # float16 scale, 32 nibbles: value k low in byte k, k + 16 high
_Q4_1_BYTES = 4 + BLOCK // 2  # float16 scale and minimum, the same nibbles
_MXFP4_BYTES = 1 + BLOCK // 2  # E8M0 exponent, 32 E2M1 codes as Q4_0's nibbles
_IQ4_NL_BYTES = 2 + BLOCK // 2  # float16 scale, 32 codes as Q4_0's nibbles


def pack_int4(kind: str) -> Callable[[np.ndarray, int], Q8_0Strips]:
    """An AWQ or GPTQ checkpoint's int4 blocks as Q8_0 strips of the same values, exactly
    (awq_gptq.to_q8_0: the group's scale, codes code - zero)."""
    def packer(blocks: np.ndarray, columns: int) -> Q8_0Strips:
        q8_0 = awq_gptq.to_q8_0(QuantizedTensor(kind, blocks, (blocks.shape[0], columns)))
        return pack_q8_0(q8_0.blocks, columns)

    return packer


def pack_fp8(kind: str) -> Callable[[np.ndarray, int], Strips]:
    """An FP8 checkpoint's e4m3 blocks (model/quant/e4m3.py) as the CPU keeps float weights
    (pack.compress: Q8_0, Q4_1 where exact), from their float32 values as fp8.py dequantizes them:
    what it kept before the GPU took the blocks packed."""
    def packer(blocks: np.ndarray, columns: int) -> Strips:
        return pack.compress(float_rows(QuantizedTensor(kind, blocks, (blocks.shape[0], columns))))

    return packer


def _blocks(blocks: np.ndarray, columns: int, block_bytes: int) -> np.ndarray:
    rows = blocks.shape[0]
    return np.require(blocks, np.uint8, ["C", "W"]).reshape(rows, columns // BLOCK, block_bytes)  # the kernels' types


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 each block holds at byte offset at (rows, blocks)."""
    return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.float16)[..., 0]


def pack_q8_0(blocks: np.ndarray, columns: int) -> Q8_0Strips:
    """Q8_0 blocks into Q8_0 strips: the same int8 values and scales."""
    src = _blocks(blocks, columns, _Q8_0_BYTES)
    strips = Q8_0Strips.zeros(blocks.shape[0], columns)
    _pack_q8_0(src, _halves(src, 0).view(np.uint16), *strips.packed_arrays())
    return strips


def pack_q4_0(blocks: np.ndarray, columns: int) -> Q4_1Strips | None:
    """Q4_0 blocks (d x (q - 8)) into Q4_1 strips: scale d, minimum -8d (exact in float16, and q x
    d - 8d has at most 15 significant bits, as (q - 8) x d has), the same nibbles. None where some
    -8d overflows float16 (d of 8192 and up): the caller rounds those weights to Q8_0."""
    src = _blocks(blocks, columns, _Q4_0_BYTES)
    d = _halves(src, 0)
    with np.errstate(over="ignore"):
        minimum = np.float16(-8) * d
    if not np.isfinite(minimum).all():
        return None
    strips = Q4_1Strips.zeros(blocks.shape[0], columns)
    _pack_q4(src, 2, d.view(np.uint16), minimum.view(np.uint16), *strips.packed_arrays())
    return strips


def pack_q4_1(blocks: np.ndarray, columns: int) -> Q4_1Strips:
    """Q4_1 blocks (d x q + m) into Q4_1 strips: the same scales, minima and nibbles."""
    src = _blocks(blocks, columns, _Q4_1_BYTES)
    strips = Q4_1Strips.zeros(blocks.shape[0], columns)
    _pack_q4(src, 4, _halves(src, 0).view(np.uint16), _halves(src, 2).view(np.uint16), *strips.packed_arrays())
    return strips


def pack_iq4_nl(blocks: np.ndarray, columns: int) -> IQ4_NLStrips:
    """IQ4_NL blocks into IQ4_NL strips: the same scales and codes."""
    src = _blocks(blocks, columns, _IQ4_NL_BYTES)
    strips = IQ4_NLStrips.zeros(blocks.shape[0], columns)
    d = _halves(src, 0).view(np.uint16)
    _pack_q4(src, 2, d, d, *strips.packed_arrays())
    return strips


def pack_mxfp4(blocks: np.ndarray, columns: int) -> MXFP4Strips:
    """MXFP4 blocks into MXFP4 strips: the same codes and exponent bytes."""
    src = _blocks(blocks, columns, _MXFP4_BYTES)
    strips = MXFP4Strips.zeros(blocks.shape[0], columns)
    _pack_mxfp4(src, strips.packed_arrays()[0], MXFP4Strips.BLOCK_BYTES - MXFP4Strips.FACTORS)
    return strips


@njit("void(uint8[:, :, ::1], uint16[:, ::1], uint8[:, :, ::1], uint16[:, :, ::1])", parallel=True,
      cache=True, nogil=True)
def _pack_q8_0(src, d, q, scale):
    """Row r, value k of a block to its place in the strip (kblocks.put_byte)."""
    rows, blocks = src.shape[0], src.shape[1]
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            row = s * STRIP + r
            for b in range(blocks):
                scale[s, b, r] = d[row, b]
                for k in range(BLOCK):
                    kblocks.put_byte(q, s, b, r, k, np.int8(src[row, b, 2 + k]))


@njit("void(uint8[:, :, ::1], int64, uint16[:, ::1], uint16[:, ::1], uint8[:, :, ::1], uint16[:, :, ::1])",
      parallel=True, cache=True, nogil=True)
def _pack_q4(src, start, d, minimum, q, factors):
    """Blocks of 32 nibbles from byte start (value k low in byte k, k + 16 high in byte k) into
    strips (kblocks.put); factors the 16 rows' scales, then minima (float16 bits) where the
    strips keep them (Q4_1's; IQ4_NL's nibbles are codes under a scale alone)."""
    rows, blocks = src.shape[0], src.shape[1]
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            row = s * STRIP + r
            for b in range(blocks):
                factors[s, b, r] = d[row, b]
                if factors.shape[2] > STRIP:
                    factors[s, b, STRIP + r] = minimum[row, b]
                for k in range(BLOCK):
                    byte = src[row, b, start + k % 16]
                    level = byte & np.uint8(15) if k < 16 else byte >> np.uint8(4)
                    kblocks.put(q, s, b, r, k, level, 0)


@njit(parallel=True, cache=True, nogil=True)
def _pack_mxfp4(src, q, exponents_at):
    """Blocks of an exponent byte and 32 codes (code k low in byte 1 + k, k + 16 high) into
    MXFP4 strips: the codes as nibbles (kblocks.put), row r's exponent at exponents_at + r."""
    rows, blocks = src.shape[0], src.shape[1]
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            row = s * STRIP + r
            for b in range(blocks):
                q[s, b, exponents_at + r] = src[row, b, 0]
                for k in range(BLOCK):
                    byte = src[row, b, 1 + k % 16]
                    kblocks.put(q, s, b, r, k, byte & np.uint8(15) if k < 16 else byte >> np.uint8(4), 0)


# GGUF type -> its packer
PACKERS: dict[str, Callable[[np.ndarray, int], Strips | None]] = {
    "q8_0": pack_q8_0,
    "q4_0": pack_q4_0,
    "q4_1": pack_q4_1,
    "q5_0": kblocks.pack_q5_0,
    "q5_1": kblocks.pack_q5_1,
    "q4_k": kblocks.pack_q4_k,
    "q5_k": kblocks.pack_q5_k,
    "q6_k": kblocks.pack_q6_k,
    "mxfp4": pack_mxfp4,
    "q2_k": kblocks.pack_q2_k,
    "q3_k": kblocks.pack_q3_k,
    "iq4_nl": pack_iq4_nl,
    "iq4_xs": kblocks.pack_iq4_xs,
    **{kind: pack_int4(kind) for kind in awq_gptq.KINDS},
    **{kind: pack_fp8(kind) for kind in e4m3.KINDS},
}
