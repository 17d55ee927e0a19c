"""A GGUF's quantized tensors as the loader hands them to ops.weight: the file's block rows
untouched (a row of a quantized tensor is a fixed number of bytes, so rows are permuted and
stacked as bytes), and the float32 values for backends that keep no blocks, as the gguf package
computes them. The CPU backend packs the blocks into strips instead (blocks.py). And a float
tensor too large to convert whole for nothing (FloatRows): packing ops read it a slab at a time.

A Fused weight is the parts of one GEMM (q, k and v; gate and up) whose kinds differ, as a
Q4_K_M file's Q4_K attn_q and attn_k and Q6_K attn_v do: each part stays in its own kind, and
linear multiplies part by part into one output.
"""

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D weight in one of GGUF's block formats, rows in Hugging Face's order."""

    kind: str  # the GGUF type, lower case: q8_0, q4_k...
    blocks: np.ndarray  # (rows, row_bytes) uint8: each row its blocks, as the file holds them
    shape: tuple[int, int]  # (rows, columns) of the values

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


@dataclass(frozen=True)
class Fused:
    """Weights stacked along their rows that stay apart: parts of different kinds."""

    parts: tuple  # each a QuantizedTensor, a float32 array, or what ops.weight made of one

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class FloatRows:
    """A 2-D float tensor handed to ops.weight unread (a Hugging Face checkpoint's embedding and
    LM head: 2.1 GB of float32 at 8B): ops that pack weights take it a slab of rows at a time,
    so that no float32 copy of it exists; the others read it whole (float32)."""

    shape: tuple[int, int]
    read_into: Callable[[int, np.ndarray], None]  # (first, out): rows first .. first + len(out) as float32

    def slabs(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, its float32 rows) for slabs of slab_rows rows; each slab's array is reused."""
        step = slab_rows(self.shape[1])
        buffer = np.empty((min(step, self.shape[0]), self.shape[1]), dtype=np.float32)
        for first in range(0, self.shape[0], step):
            part = buffer[:min(step, self.shape[0] - first)]
            self.read_into(first, part)
            yield first, part

    def read(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=np.float32)
        self.read_into(0, out)
        return out


def fuse(parts: list) -> "QuantizedTensor | Fused":
    """Parts of one GEMM, at least one quantized: each run of parts of one kind stacked as block
    rows (all of them where they share a kind, as they usually do; a Q4_K_M file's Q4_K q and k
    beside its Q6_K v), a Fused of the runs where kinds differ."""
    runs: list[list] = []
    for p in parts:
        if runs and isinstance(p, QuantizedTensor) and isinstance(runs[-1][0], QuantizedTensor) \
                and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    stacked = [run[0] if len(run) == 1 else
               QuantizedTensor(run[0].kind, np.concatenate([p.blocks for p in run]),
                               (sum(p.shape[0] for p in run), run[0].shape[1])) for run in runs]
    return stacked[0] if len(stacked) == 1 else Fused(tuple(stacked))


def take_rows(w, index: np.ndarray):
    """w's rows (a float array's, a QuantizedTensor's block rows) in index's order; in a Fused,
    each index stays within its part."""
    if isinstance(w, QuantizedTensor):
        return replace(w, blocks=w.blocks[index])
    if isinstance(w, Fused):
        parts, first = [], 0
        for p in w.parts:
            parts.append(take_rows(p, index[first:first + p.shape[0]] - first))
            first += p.shape[0]
        return Fused(tuple(parts))
    return w[index]


SLAB_VALUES = 1 << 22  # values dequantized at a time: gguf's temporaries are several times these


def slab_rows(columns: int) -> int:
    """Rows of about SLAB_VALUES values, a multiple of 16 (a strip of packed rows)."""
    return max(16, SLAB_VALUES // columns // 16 * 16)


def dequantize(t: QuantizedTensor) -> np.ndarray:
    """The float32 values, as the gguf package computes them, a slab of rows at a time: its
    temporaries for a whole 128k-token embedding would be gigabytes."""
    import gguf

    from model.quant import e4m3, int4

    if t.kind in int4.KINDS:
        return int4.dequantize(t)
    if t.kind in e4m3.KINDS:
        return e4m3.dequantize(t)
    kind = gguf.GGMLQuantizationType[t.kind.upper()]
    out = np.empty(t.shape, dtype=np.float32)
    step = slab_rows(t.shape[1])
    for first in range(0, t.shape[0], step):
        part = t.blocks[first:first + step]
        out[first:first + part.shape[0]] = gguf.quants.dequantize(part, kind).reshape(part.shape[0], t.shape[1])
    return out


def float32(w) -> np.ndarray:
    """Any weight the loader makes as one float32 array: for backends that keep no blocks."""
    if isinstance(w, QuantizedTensor):
        return dequantize(w)
    if isinstance(w, Fused):
        return np.concatenate([float32(p) for p in w.parts])
    if isinstance(w, FloatRows):
        return w.read()
    return w
