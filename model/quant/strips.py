"""The packed weight schemes of the CPU backend, one class each: its kind, its constants, and its
strips read back as float32. Packing is pack.py's and kblocks.py's, multiplying matmul.py's.

Q8_0 is llama.cpp's: 32 int8 values and one float16 scale per block along each weight row (8.5
bits a weight; float32 is 32). The others keep a GGUF's 4-, 5- and 6-bit values as they come,
nothing rounded again: each value's low four bits two to a byte (a nibble plane), its fifth and
sixth bits packed below them, and the file's float16 factors, so that they read back bit for
bit as gguf-py dequantizes. Factors are float16 because a decode step at batch 1 is bound by
the bytes it reads: float32 ones cost Q8_0 6% more bytes, Q4_0 files 20%. The kernels widen
them exactly to float32 (gemv.py), on every CPU.

A strip is 16 weight rows; each (strip, block) holds its 16 x 32 values as 8 lines of 64, line
l holding weights 4l to 4l + 3 of the block for each of the 16 rows in turn (byte 4r + k % 4 of
the line for row r, weight k). That is the order a vector unit wants: one line times a
broadcast quad of int8 activations gives the 16 rows' partial sums in 16 lanes (vpdpbusd), with
no reduction across lanes. Values are stored unsigned (Q8_0's int8 plus 128), the kernels
taking ZERO times the activations' sum off. Rows past the last are zero.

In a nibble scheme a (strip, block) is 256 bytes of nibbles (64-byte group p: line 2p in the
low nibbles, line 2p + 1 in the high ones), then HIGH_BITS x 64 bytes of the bits above: groups
of 64 bytes, each byte j of group g holding the high bits of value j of 8 // HIGH_BITS lines
(line g x 8 // HIGH_BITS + i at bit HIGH_BITS x i), so that a line's high bits are a shift and a
mask of one vector, as its nibbles are (bit planes, a 64-lane mask per line, took 2-3x the time
of the nibbles on AVX-512). A weight is scale x (value - ZERO), plus the row's minimum where the
scheme has MINIMA; with SCALES = 2, lines 0-3 (weights 0-15 of the block) and lines 4-7 have a
scale each (Q6_K's sub-blocks of 16). Factors per (strip, block): the 16 rows' scales (twice
with SCALES = 2), then their minima (twice with SCALES = 2: Q2_K's).

With SUB_SCALES (the K-quants' compact form) those factors are the file's integers, a byte
each (int8 where SIGNED, Q6_K's), at the end of q's (strip, block), and the float16 factors are
per (strip, 256 weights): Q4_K's and Q5_K's d, then -dmin, Q6_K's d twice (once per scale). The
kernels multiply them, widened, by the block's integers to the float32 factors gguf-py
computes: 4.625 bits a weight for Q4_K (the file's 4.5), 5.625 for Q5_K (5.5), 6.625 for Q6_K
(6.5625).

MXFP4 (GPT-OSS's experts) keeps the file's 4-bit codes as its nibbles and its E8M0 exponent bytes
as its factors, at the end of q's (strip, block) as SUB_SCALES's integers are, with no float16
factors at all: 4.25 bits a weight, the file's own. A code stands for a level of LEVELS (the
kernels map it with a byte shuffle, gemv.py), and a weight is 2^(e - 128) x (level - ZERO): the
powers of two span float32's range, float16's only a sliver of it, so the kernels build each
from its exponent's bits as gguf-py does.
"""

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

BLOCK = 32
STRIP = 16  # weight rows a strip holds: 16 float32 lanes of one AVX-512 register
QUAD = 4  # a row's weights in a line: the bytes vpdpbusd sums into one int32 lane
LINES = BLOCK // QUAD  # lines per (strip, block)
LINE_BYTES = STRIP * QUAD
NIBBLE_BYTES = STRIP * BLOCK // 2  # the nibble plane of a (strip, block)
HIGH_BYTES = STRIP * BLOCK // 8  # a (strip, block)'s bytes per high bit
SUPER_BLOCKS = 8  # blocks under one float16 factor with SUB_SCALES: a K-quant super-block


@dataclass
class Strips:
    """A weight's values (q) and float16 factors per (strip, block), in strip order."""

    q: np.ndarray  # (strips, blocks, BLOCK_BYTES) int8
    factors: np.ndarray  # (strips, blocks, FACTORS) float16; with SUB_SCALES, per super-block
    rows: int  # the weight's rows; the strips may hold up to 15 more, zero

    kind: ClassVar[str]  # the scheme's name, as GGUF spells it
    NIBBLES: ClassVar[bool]  # low four bits two a byte (else one int8 value a byte)
    HIGH_BITS: ClassVar[int] = 0  # bits above the nibbles
    ZERO: ClassVar[int] = 0  # subtracted from every value
    SIGNED_VALUES: ClassVar[bool] = False  # values int8, stored as bytes plus 128 (ZERO = 128)
    SCALES: ClassVar[int] = 1  # scales per (row, block): 2 for a scale per 16 weights
    MINIMA: ClassVar[bool] = False  # a minimum per (row, block) added, or per scale with SCALES = 2
    SUB_SCALES: ClassVar[bool] = False  # factors as 8-bit integers in q under float16 per 256 weights
    SIGNED: ClassVar[bool] = False  # those integers int8 (else uint8)
    LEVELS: ClassVar[tuple[int, ...] | None] = None  # the byte each 4-bit code stands for, where nibbles are codes
    EXPONENTS: ClassVar[bool] = False  # factors as E8M0 bytes in q (2^(e - 128)), no float16 ones
    BLOCK_BYTES: ClassVar[int]  # bytes of q per (strip, block)
    FACTORS: ClassVar[int]  # float16 factors per (strip, block)

    def __init_subclass__(cls):
        cls.FACTORS = STRIP * cls.SCALES * (1 + cls.MINIMA)
        cls.BLOCK_BYTES = ((NIBBLE_BYTES + cls.HIGH_BITS * HIGH_BYTES if cls.NIBBLES else STRIP * BLOCK)
                           + (cls.SUB_SCALES or cls.EXPONENTS) * cls.FACTORS)

    @classmethod
    def zeros(cls, rows: int, columns: int) -> "Strips":
        """Zeroed strips for a (rows, columns) weight, so that the rows past its last stay zero."""
        strips, blocks = -(-rows // STRIP), columns // BLOCK
        return cls(np.zeros((strips, blocks, cls.BLOCK_BYTES), dtype=np.int8),
                   np.zeros((strips, -(-blocks // SUPER_BLOCKS) if cls.SUB_SCALES else blocks,
                             0 if cls.EXPONENTS else cls.FACTORS), dtype=np.float16), rows)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.q.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.factors.nbytes

    def packed_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """q as uint8 and the factors as their float16 bits (uint16): the arrays the packers write."""
        return self.q.view(np.uint8), self.factors.view(np.uint16)

    def dequantize(self, rows=slice(None)) -> np.ndarray:
        """The float32 rows (all, or those an index picks: the embedding's lookup), each weight
        computed as gguf-py does: one product, plus the minimum. Only the strips that hold the
        rows are decoded: a step's lookup in a 128k-row table touches a handful."""
        index = np.arange(self.rows)[rows]
        held, strip_of = np.unique(index // STRIP, return_inverse=True)
        if 0 < len(held) < self.q.shape[0]:
            part = replace(self, q=self.q[held], factors=self.factors[held], rows=len(held) * STRIP)
            return part.dequantize(strip_of.reshape(-1) * STRIP + index % STRIP)
        strips, blocks = self.q.shape[:2]
        if not len(index):
            return np.empty((0, blocks * BLOCK), dtype=np.float32)
        lines = self._values().reshape(strips, blocks, LINES, STRIP, QUAD)
        values = lines[index // STRIP, :, :, index % STRIP, :]  # (rows, blocks, line, quad)
        factors = self.block_factors().reshape(strips, blocks, -1, STRIP)[index // STRIP, :, :, index % STRIP]
        scales = factors[..., np.arange(LINES) * self.SCALES // LINES]  # (rows, blocks, line)
        out = values * scales[..., None]
        if self.MINIMA:
            out = out + factors[..., self.SCALES + np.arange(LINES) * self.SCALES // LINES][..., None]
        return out.reshape(len(index), blocks * BLOCK).astype(np.float32)

    def block_factors(self) -> np.ndarray:
        """The float32 factors per (strip, block): with SUB_SCALES, the integers times their float16;
        with EXPONENTS, 2^(e - 128) for each byte e, as gguf-py builds it (e8m0_to_fp32_half)."""
        factors = self.factors.astype(np.float32)  # exact
        if not (self.SUB_SCALES or self.EXPONENTS):
            return factors
        ints = self.q.view(np.int8 if self.SIGNED else np.uint8)[..., self.BLOCK_BYTES - self.FACTORS:]
        if self.EXPONENTS:
            e = ints.astype(np.uint32)
            return np.where(e < 2, np.uint32(0x200000) << e, (e - np.uint32(1)) << np.uint32(23)).view(np.float32)
        return np.repeat(factors, SUPER_BLOCKS, axis=1)[:, :ints.shape[1]] * ints.astype(np.float32)

    def _values(self) -> np.ndarray:
        """The values less ZERO, one per element, in strip order: (strips, blocks, 16 x 32)."""
        packed = self.q.view(np.uint8)
        if not self.NIBBLES:
            return packed.astype(np.int16) - np.int16(self.ZERO)
        strips, blocks = self.q.shape[:2]
        nibbles = packed[..., :NIBBLE_BYTES].reshape(strips, blocks, LINES // 2, 1, LINE_BYTES)
        values = np.concatenate([nibbles & 15, nibbles >> 4], axis=3).reshape(strips, blocks, -1)
        if self.LEVELS:
            values = np.array(self.LEVELS, dtype=np.uint8)[values]
        if self.HIGH_BITS:
            lines = 8 // self.HIGH_BITS  # that share a byte
            high = packed[..., NIBBLE_BYTES:NIBBLE_BYTES + self.HIGH_BITS * HIGH_BYTES]
            shifts = np.arange(0, 8, self.HIGH_BITS, dtype=np.uint8)[:, None]
            bits = (high.reshape(strips, blocks, -1, 1, LINE_BYTES) >> shifts) & np.uint8((1 << self.HIGH_BITS) - 1)
            values |= bits.reshape(strips, blocks, -1) << np.uint8(4)
        return values.astype(np.int16) - np.int16(self.ZERO)


class Q8_0Strips(Strips):
    """Q8_0: q holds each line's 64 values, as uint8 (int8 plus 128); factors are the 16 rows'
    scales."""

    kind, NIBBLES, ZERO, SIGNED_VALUES = "q8_0", False, 128, True


class Q4_1Strips(Strips):
    """Q4_1 (a weight is scale x q + minimum, q in 0..15): the nibble plane; factors
    the 16 rows' scales, then minima (5 bits a weight, as the file's)."""

    kind, NIBBLES, MINIMA = "q4_1", True, True


class Q4_KStrips(Strips):
    """Q4_K as Q4_1Strips, its scales and minima 6-bit integers under d and -dmin per 256 weights."""

    kind, NIBBLES, MINIMA, SUB_SCALES = "q4_k", True, True, True


class Q5_0Strips(Strips):
    """Q5_0 (scale x (q - 16), q in 0..31): nibbles and one high bit; factors the scales
    (5.5 bits a weight, as the file's)."""

    kind, NIBBLES, HIGH_BITS, ZERO = "q5_0", True, 1, 16


class Q5_1Strips(Strips):
    """Q5_1 (scale x q + minimum, q in 0..31): nibbles, one high bit, scales and
    minima (6 bits a weight, as the file's)."""

    kind, NIBBLES, HIGH_BITS, MINIMA = "q5_1", True, 1, True


class Q5_KStrips(Strips):
    """Q5_K as Q5_1Strips, its scales and minima 6-bit integers under d and -dmin per 256 weights."""

    kind, NIBBLES, HIGH_BITS, MINIMA, SUB_SCALES = "q5_k", True, 1, True, True


class Q6_KStrips(Strips):
    """Q6_K (d x sc x (q - 32), q in 0..63, one int8 sc per 16 weights): nibbles and two bit
    planes, two scales per (row, block), each sc under d. 6.625 bits a weight against the file's
    6.56, where int8 lines (as Q8_0's) would read 10: a GEMV is bound by the bytes it reads, and
    widening the bit planes is the same work as Q5's."""

    kind, NIBBLES, HIGH_BITS, ZERO, SCALES, SUB_SCALES, SIGNED = "q6_k", True, 2, 32, 2, True, True


class MXFP4Strips(Strips):
    """MXFP4 (blocks of 32 E2M1 codes under one E8M0 exponent e): the codes' nibble plane and the
    exponents. Doubled, E2M1's levels are the integers 0, 1, 2, 3, 4, 6, 8, 12 and their
    negatives, held here plus 12 (unsigned bytes, as the kernels take weights) under 2^(e - 128)."""

    kind, NIBBLES, ZERO, EXPONENTS = "mxfp4", True, 12, True
    LEVELS = tuple(12 + level for level in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12))


class Q2_KStrips(Strips):
    """Q2_K (d x sc x q - dmin x m, q in 0..3, a 4-bit sc and m per 16 weights): the two bits in
    the nibble plane, a scale and a minimum per 16 as integers under d and -dmin per 256. 5.25
    bits a weight against the file's 2.625; Q8_0 would be 8.5."""

    kind, NIBBLES, SCALES, MINIMA, SUB_SCALES = "q2_k", True, 2, True, True


class Q3_KStrips(Strips):
    """Q3_K (d x sc x (q - 4), q in 0..7, one 6-bit signed sc per 16 weights): Q6_K's form with
    the three bits in the nibble plane, no high bits. 4.625 bits a weight against the file's
    3.4375: a 2-bit plane would need kernels of its own."""

    kind, NIBBLES, ZERO, SCALES, SUB_SCALES, SIGNED = "q3_k", True, 4, 2, True, True


IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


class IQ4_NLStrips(Strips):
    """IQ4_NL (d x level, 32 4-bit codes of a non-linear table a block): the codes' nibble plane,
    each level (int8) held as Q8_0's values are, plus 128 (the kernels map codes with MXFP4's
    shuffle, then take the bytes as Q8_0's: levels past 63 would saturate pmaddubsw), the
    scales as factors: 4.5 bits a weight, the file's."""

    kind, NIBBLES, ZERO, SIGNED_VALUES = "iq4_nl", True, 128, True
    LEVELS = tuple(128 + level for level in IQ4_NL_LEVELS)


class IQ4_XSStrips(IQ4_NLStrips):
    """IQ4_XS: IQ4_NL's codes under one 6-bit signed scale a block and float16 d per 256 weights
    (the K-quants' compact form): 4.3125 bits a weight against the file's 4.25."""

    kind, SUB_SCALES, SIGNED = "iq4_xs", True, True


SCHEMES = {weights.kind: weights for weights in (Q8_0Strips, Q4_1Strips, Q4_KStrips, Q5_0Strips, Q5_1Strips, Q5_KStrips,
                                                 Q6_KStrips, MXFP4Strips, Q2_KStrips, Q3_KStrips, IQ4_NLStrips,
                                                 IQ4_XSStrips)}

