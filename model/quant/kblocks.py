"""GGUF's K-quant, 5-bit and IQ4_XS tensors into strips as they are, nothing rounded again:
Q2_K into Q2_KStrips, Q3_K into Q3_KStrips, Q4_K into Q4_KStrips, Q5_0 into Q5_0Strips, Q5_1 into Q5_1Strips, Q5_K
into Q5_KStrips, Q6_K into Q6_KStrips, IQ4_XS into IQ4_XSStrips.

Each packer reads the tensor's bytes (rows, row_bytes), row r being weight row r, as gguf-py's
dequantizers lay them out, and keeps each factor as they compute it: the float16 d (and dmin)
as it is, and for the K-quants the sub-blocks' integers beside d and -dmin for the kernels to
multiply (in float32, exact), so that the strips read back bit for bit. One numba pass over the strips on all cores.
"""

import numpy as np
from numba import njit, prange

from model.errors import ModelError
from model.quant.strips import (BLOCK, LINE_BYTES, NIBBLE_BYTES, QUAD, STRIP, IQ4_XSStrips, Q2_KStrips, Q3_KStrips,
                                 Q4_KStrips, Q5_0Strips, Q5_1Strips, Q5_KStrips, Q6_KStrips, Strips)

QK_K = 256  # weights per K-quant super-block
SUB_BLOCKS = QK_K // BLOCK


@njit(cache=True, nogil=True, inline="always")
def _half(lo, hi):
    """The float16 in bytes lo, hi (little-endian), as its bits."""
    return np.uint16(np.uint16(lo) | (np.uint16(hi) << np.uint16(8)))


NEGATIVE = np.uint16(0x8000)  # a float16's sign bit: x ^ NEGATIVE is -x, exactly


@njit(cache=True, nogil=True, inline="always")
def _place(r, k):
    """Row r, weight k of a block: its line and its byte in the line (strips.py)."""
    return k // QUAD, QUAD * r + k % QUAD


@njit(cache=True, nogil=True, inline="always")
def put(q, s, b, r, k, value, high_bits):
    """Value (its low 4 + high_bits bits) of row r, weight k of block b into strip s (uint8):
    line k // 4, byte 4r + k % 4 of the line, its nibble, and its high bits at bit
    high_bits x (line % lines) of byte `byte` of the high group line // lines, where lines =
    8 // high_bits lines share a byte (strips.py)."""
    line, byte = _place(r, k)
    q[s, b, LINE_BYTES * (line // 2) + byte] |= np.uint8((value & 15) << (4 * (line % 2)))
    if high_bits:
        lines = 8 // high_bits
        q[s, b, NIBBLE_BYTES + LINE_BYTES * (line // lines) + byte] |= np.uint8(
            ((value >> 4) & ((1 << high_bits) - 1)) << (high_bits * (line % lines)))


@njit(cache=True, nogil=True, inline="always")
def put_byte(q, s, b, r, k, value):
    """Q8_0's int8 value of row r, weight k of block b into strip s (uint8), plus 128: byte
    4r + k % 4 of line k // 4 (strips.py)."""
    line, byte = _place(r, k)
    q[s, b, LINE_BYTES * line + byte] = np.uint8(value + 128)


@njit(cache=True, nogil=True, inline="always")
def _scale_min(data, at, j):
    """Sub-block j's 6-bit scale and minimum from the 12 bytes at data[at:] (get_scale_min_k4)."""
    if j < 4:
        return data[at + j] & 63, data[at + j + 4] & 63
    return ((data[at + j + 4] & 15) | ((data[at + j - 4] >> 6) << 4),
            (data[at + j + 4] >> 4) | ((data[at + j] >> 6) << 4))


@njit(parallel=True, cache=True, nogil=True)
def _pack_affine_k(blocks, q, factors, rows, block_bytes, high_bits, ints_at):
    """Q4_K (144 bytes: d, dmin, scales[12], qs[128]) and Q5_K (176 bytes: d, dmin, scales[12],
    qh[32], qs[128]): d and -dmin per super-block, sub-block j's sc_j and m_j at ints_at in its
    block of q; its weight i the nibble of qs[32 (j // 2) + i] (low for even j), Q5_K's fifth
    bit bit j of qh[i]."""
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            data = blocks[s * STRIP + r]
            for sb in range(q.shape[1] // SUB_BLOCKS):
                at = sb * block_bytes
                factors[s, sb, r] = _half(data[at], data[at + 1])
                factors[s, sb, STRIP + r] = _half(data[at + 2], data[at + 3]) ^ NEGATIVE
                qs = at + 16 + 32 * high_bits
                for j in range(SUB_BLOCKS):
                    sc, m = _scale_min(data, at + 4, j)
                    b = sb * SUB_BLOCKS + j
                    q[s, b, ints_at + r], q[s, b, ints_at + STRIP + r] = sc, m
                    for i in range(BLOCK):
                        value = (data[qs + 32 * (j // 2) + i] >> (4 * (j % 2))) & 15
                        if high_bits:
                            value |= ((data[at + 16 + i] >> j) & 1) << 4
                        put(q, s, b, r, i, value, high_bits)


@njit(parallel=True, cache=True, nogil=True)
def _pack_q5(blocks, q, factors, rows, minima):
    """Q5_0 (22 bytes: d, qh[4], qs[16]) and Q5_1 (24 bytes: d, m, qh[4], qs[16]): weight i the
    nibble of qs[i % 16] (low for i < 16) and bit i of the little-endian uint32 qh."""
    block_bytes = 24 if minima else 22
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            data = blocks[s * STRIP + r]
            for b in range(q.shape[1]):
                at = b * block_bytes
                factors[s, b, r] = _half(data[at], data[at + 1])
                if minima:
                    factors[s, b, STRIP + r] = _half(data[at + 2], data[at + 3])
                qh, qs = at + 2 + 2 * minima, at + 6 + 2 * minima
                for i in range(BLOCK):
                    value = ((data[qs + i % 16] >> (4 * (i // 16))) & 15) | (((data[qh + i // 8] >> (i % 8)) & 1) << 4)
                    put(q, s, b, r, i, value, 1)


@njit(parallel=True, cache=True, nogil=True)
def _pack_q6_k(blocks, q, factors, rows, ints_at):
    """Q6_K (210 bytes: ql[128], qh[64], scales[16] int8, d): value v = 32j + i of a super-block
    (h = j // 4, c = j % 4) has low bits the nibble of ql[64h + 32 (c % 2) + i] (high for c >= 2)
    and high bits bits 2c, 2c + 1 of qh[32h + i]; block j's scales[2j], scales[2j + 1] at ints_at
    in its block of q, d once for each."""
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            data = blocks[s * STRIP + r]
            for sb in range(q.shape[1] // SUB_BLOCKS):
                at = sb * 210
                factors[s, sb, r] = factors[s, sb, STRIP + r] = _half(data[at + 208], data[at + 209])
                for j in range(SUB_BLOCKS):
                    h, c, b = j // 4, j % 4, sb * SUB_BLOCKS + j
                    for half in range(2):
                        q[s, b, ints_at + half * STRIP + r] = data[at + 192 + 2 * j + half]
                    for i in range(BLOCK):
                        low = (data[at + 64 * h + 32 * (c % 2) + i] >> (4 * (c // 2))) & 15
                        high = (data[at + 128 + 32 * h + i] >> (2 * c)) & 3
                        put(q, s, b, r, i, low | (high << 4), 2)


@njit(parallel=True, cache=True, nogil=True)
def _pack_q2_k(blocks, q, factors, rows, ints_at):
    """Q2_K (84 bytes: scales[16], qs[64], d, dmin): weight w = 32k + i of a super-block has bits
    2c, 2c + 1 of qs[32 (k // 4) + i] (c = k % 4); sub-block j's (16 weights) scale the low
    nibble of scales[j], its minimum the high one; d for a block's two scales, -dmin for its
    two minima."""
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            data = blocks[s * STRIP + r]
            for sb in range(q.shape[1] // SUB_BLOCKS):
                at = sb * 84
                d, minus_dmin = _half(data[at + 80], data[at + 81]), _half(data[at + 82], data[at + 83]) ^ NEGATIVE
                for half in range(2):
                    factors[s, sb, half * STRIP + r], factors[s, sb, (2 + half) * STRIP + r] = d, minus_dmin
                for k in range(SUB_BLOCKS):
                    b = sb * SUB_BLOCKS + k
                    for half in range(2):
                        q[s, b, ints_at + half * STRIP + r] = data[at + 2 * k + half] & 15
                        q[s, b, ints_at + (2 + half) * STRIP + r] = data[at + 2 * k + half] >> 4
                    for i in range(BLOCK):
                        put(q, s, b, r, i, (data[at + 16 + 32 * (k // 4) + i] >> (2 * (k % 4))) & 3, 0)


@njit(parallel=True, cache=True, nogil=True)
def _pack_q3_k(blocks, q, factors, rows, ints_at):
    """Q3_K (110 bytes: hmask[32], qs[64], scales[12], d): weight w = 32k + i of a super-block
    (h = k // 4, c = k % 4) has low bits bits 2c, 2c + 1 of qs[32h + i] and third bit bit k of
    hmask[i] (q - 4 is gguf-py's value); sub-block j's scale (16 weights) the nibble j % 8 of
    scales[0:8] (high for j >= 8) below bits 2 (j // 4), 2 (j // 4) + 1 of scales[8 + j % 4],
    less 32; d once for each of a block's two scales."""
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            data = blocks[s * STRIP + r]
            for sb in range(q.shape[1] // SUB_BLOCKS):
                at = sb * 110
                factors[s, sb, r] = factors[s, sb, STRIP + r] = _half(data[at + 108], data[at + 109])
                for k in range(SUB_BLOCKS):
                    b = sb * SUB_BLOCKS + k
                    for half in range(2):
                        j = 2 * k + half
                        low = (data[at + 96 + j % 8] >> (4 * (j // 8))) & 15
                        high = (data[at + 104 + j % 4] >> (2 * (j // 4))) & 3
                        q[s, b, ints_at + half * STRIP + r] = np.uint8((low | (high << 4)) - 32)
                    for i in range(BLOCK):
                        low = (data[at + 32 + 32 * (k // 4) + i] >> (2 * (k % 4))) & 3
                        put(q, s, b, r, i, low | (((data[at + i] >> k) & 1) << 2), 0)


@njit(parallel=True, cache=True, nogil=True)
def _pack_iq4_xs(blocks, q, factors, rows, ints_at):
    """IQ4_XS (136 bytes: d, scales_h (uint16), scales_l[4], qs[128]): block j's scale the nibble
    j % 2 of scales_l[j // 2] below bits 2j, 2j + 1 of scales_h, less 32; its weight i the code in
    the nibble of qs[16j + i % 16] (high for i >= 16)."""
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            data = blocks[s * STRIP + r]
            for sb in range(q.shape[1] // SUB_BLOCKS):
                at = sb * 136
                factors[s, sb, r] = _half(data[at], data[at + 1])
                high_bits = _half(data[at + 2], data[at + 3])
                for j in range(SUB_BLOCKS):
                    b = sb * SUB_BLOCKS + j
                    low = (data[at + 4 + j // 2] >> (4 * (j % 2))) & 15
                    q[s, b, ints_at + r] = np.uint8((low | (((high_bits >> (2 * j)) & 3) << 4)) - 32)
                    for i in range(BLOCK):
                        put(q, s, b, r, i, (data[at + 8 + 16 * j + i % 16] >> (4 * (i // 16))) & 15, 0)


def _strips(weights: type[Strips], name: str, blocks: np.ndarray, columns: int, per: int, size: int) -> Strips:
    """Zeroed strips for blocks, once they are a (rows, columns / per x size) uint8 array."""
    if columns <= 0 or columns % per:
        raise ModelError(f"a {name} tensor's rows must be a multiple of {per} weights, not {columns}")
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != columns // per * size:
        raise ModelError(f"{name} data of shape {blocks.shape} ({blocks.dtype}) is not rows of {columns} weights"
                         f" ({columns // per * size} bytes); the file is inconsistent")
    return weights.zeros(blocks.shape[0], columns)


def _super_blocks(scheme: type[Strips], size: int, pack, blocks: np.ndarray, columns: int, *args) -> Strips:
    """blocks of 256 weights (size bytes each) packed by the kernel pack into scheme's strips, its
    sub-blocks' integers at the end of each (strip, block) of q; args before that offset."""
    strips = _strips(scheme, scheme.kind.upper(), blocks, columns, QK_K, size)
    pack(np.ascontiguousarray(blocks), *strips.packed_arrays(), strips.rows, *args, scheme.BLOCK_BYTES - scheme.FACTORS)
    return strips


def pack_q4_k(blocks: np.ndarray, columns: int) -> Q4_KStrips:
    return _super_blocks(Q4_KStrips, 144, _pack_affine_k, blocks, columns, 144, 0)


def pack_q5_k(blocks: np.ndarray, columns: int) -> Q5_KStrips:
    return _super_blocks(Q5_KStrips, 176, _pack_affine_k, blocks, columns, 176, 1)


def pack_q2_k(blocks: np.ndarray, columns: int) -> Q2_KStrips:
    return _super_blocks(Q2_KStrips, 84, _pack_q2_k, blocks, columns)


def pack_q3_k(blocks: np.ndarray, columns: int) -> Q3_KStrips:
    return _super_blocks(Q3_KStrips, 110, _pack_q3_k, blocks, columns)


def pack_iq4_xs(blocks: np.ndarray, columns: int) -> IQ4_XSStrips:
    return _super_blocks(IQ4_XSStrips, 136, _pack_iq4_xs, blocks, columns)


def pack_q6_k(blocks: np.ndarray, columns: int) -> Q6_KStrips:
    return _super_blocks(Q6_KStrips, 210, _pack_q6_k, blocks, columns)


def pack_q5_0(blocks: np.ndarray, columns: int) -> Q5_0Strips:
    strips = _strips(Q5_0Strips, "Q5_0", blocks, columns, BLOCK, 22)
    _pack_q5(np.ascontiguousarray(blocks), *strips.packed_arrays(), strips.rows, False)
    return strips


def pack_q5_1(blocks: np.ndarray, columns: int) -> Q5_1Strips:
    strips = _strips(Q5_1Strips, "Q5_1", blocks, columns, BLOCK, 24)
    _pack_q5(np.ascontiguousarray(blocks), *strips.packed_arrays(), strips.rows, True)
    return strips
