"""The packed weight schemes of the CPU backend, one class each: its kind, its constants, and its
strips read back as float32. Packing is pack.py's, multiplying matmul.py's.

Q8_0 is llama.cpp's: 32 int8 values and one float32 scale per block along each weight row (9
bits a weight; float32 is 32). A weight that is exactly Q4_1 (each block a minimum plus a scale
times 0..15, as a GGUF's Q4_1 tensors come: the default model's projections do) is kept so
instead, two values a byte (6 bits a weight with its float32 scale and minimum): nothing
rounded again, and fewer bytes to read.

A strip is 16 weight rows; each (strip, block) holds its 16 x 32 values as 16 lines of 32, line
r holding weights 2r and 2r+1 of the block for each of the 16 rows in turn. That is the order a
vector unit wants: one line times a broadcast pair of activations gives the 16 rows' partial
sums in 16 lanes (vpmaddwd), with no reduction across lanes, and it is the layout of an AMX
bfloat16 tile of the weights. Rows past the last are zero.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

BLOCK = 32
STRIP = 16  # weight rows a strip holds: an AMX tile's width in float32 outputs


@dataclass
class Strips(ABC):
    """A weight's values (q) and float32 factors per (strip, block), in strip order."""

    q: np.ndarray  # (strips, blocks, BLOCK_BYTES) int8
    factors: np.ndarray  # (strips, blocks, FACTORS) float32
    rows: int  # the weight's rows; the strips may hold up to 15 more, zero

    kind: ClassVar[str]  # the scheme's name, as GGUF spells it
    BLOCK_BYTES: ClassVar[int]  # bytes of q per (strip, block)
    FACTORS: ClassVar[int]  # float32 factors per (strip, block)
    NIBBLES: ClassVar[bool]  # two values a byte: the literal the kernels are compiled for

    @classmethod
    def zeros(cls, rows: int, columns: int) -> "Strips":
        """Zeroed strips for a (rows, columns) weight, so that the rows past its last stay zero."""
        strips, blocks = -(-rows // STRIP), columns // BLOCK
        return cls(np.zeros((strips, blocks, cls.BLOCK_BYTES), dtype=np.int8),
                   np.zeros((strips, blocks, cls.FACTORS), dtype=np.float32), rows)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.q.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.factors.nbytes

    def dequantize(self, rows=slice(None)) -> np.ndarray:
        """The float32 rows (all, or those an index picks: the embedding's lookup)."""
        index = np.arange(self.rows)[rows]
        strips, blocks = self.q.shape[:2]
        lines = self._lines().reshape(strips, blocks, BLOCK // 2, STRIP, 2)
        values = lines[index // STRIP, :, :, index % STRIP, :]  # (rows, blocks, pair, 2)
        scale = self.factors[index // STRIP, :, index % STRIP]  # (rows, blocks)
        out = self._offset(values.reshape(len(index), blocks, BLOCK) * scale[..., None], index)
        return out.reshape(len(index), blocks * BLOCK).astype(np.float32)

    @abstractmethod
    def _lines(self) -> np.ndarray:
        """The values, one per byte, in strip order."""

    @abstractmethod
    def _offset(self, scaled: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The scaled values of rows index plus what the scheme adds to each block."""


class Q8_0Strips(Strips):
    """Q8_0: q holds each line's 32 int8 values; factors are the 16 rows' scales."""

    kind, BLOCK_BYTES, FACTORS, NIBBLES = "q8_0", STRIP * BLOCK, STRIP, False

    def _lines(self) -> np.ndarray:
        return self.q

    def _offset(self, scaled: np.ndarray, index: np.ndarray) -> np.ndarray:
        return scaled


class Q4_1Strips(Strips):
    """Q4_1 (a weight is scale x q + minimum, q in 0..15): each byte two lines' values, line 2p in
    its low nibble, line 2p + 1 in its high one; factors are the 16 rows' scales, then minima."""

    kind, BLOCK_BYTES, FACTORS, NIBBLES = "q4_1", STRIP * BLOCK // 2, 2 * STRIP, True

    def _lines(self) -> np.ndarray:
        strips, blocks = self.q.shape[:2]
        packed = self.q.view(np.uint8).reshape(strips, blocks, BLOCK // 4, 1, STRIP * 2)
        return np.concatenate([packed & 15, packed >> 4], axis=3)

    def _offset(self, scaled: np.ndarray, index: np.ndarray) -> np.ndarray:
        return scaled + self.factors[index // STRIP, :, STRIP + index % STRIP][..., None]


def scheme(nibbles: bool) -> type[Strips]:
    """The scheme a kernel compiled for the literal nibbles multiplies."""
    return Q4_1Strips if nibbles else Q8_0Strips
