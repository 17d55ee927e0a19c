"""A GGUF's quantized weights kept packed on the device by CudaOps: an 8B Q4_K_M holds about 5 GB
there instead of the 16 GB of its bf16 values. AWQ and GPTQ checkpoints' int4 weights likewise, as
the int4 blocks they are repacked into at load (model/quant/awq_gptq.py), and FP8 checkpoints'
e4m3 weights as e4m3 blocks with a float32 scale (model/quant/e4m3.py: an 8B in about 9 GB).

A tensor of a type cuda/dequant_gemv.cu decodes (kernels.PACKED_TYPES: Q8_0, Q4_0, Q4_1, Q4_K,
Q5_K, Q6_K, INT4_32, INT4_128, FP8_32, FP8_128) goes to the device as its block rows, untouched;
any other type is dequantized to the storage type on the host, as before. Up to GEMV_ROWS
activation rows (decode steps) multiply the blocks in dequant_gemv, which decodes each block's
scales as it reads it and sums each output in one fixed order, so a row's bits do not depend on the
others in the batch. More rows (prefill, decode batches past 8) take the simplest correct route:
the weight dequantized a tile of rows at a time into a scratch buffer of the storage type, then the
launcher's GEMM (cuBLAS on a GPU) as for a bf16 weight. Those rows' bits are the GEMM's, as for
unpacked weights.

GEMV_ROWS is 8, an estimate to measure on a device: dequant_gemv's fp32 multiply-adds per weight
byte grow with the rows while the scratch route costs about 8 times the packed bytes in traffic
(a 4.5-bit weight written and read back as 16 bits) whatever the rows, and cuBLAS's tensor cores
take over from there.
"""

import logging
import math
from dataclasses import dataclass

import numpy as np

from model.ops.dtypes import ARRAY_DTYPES
from model.ops.kernels import PACKED_TYPES
from model.quant import e4m3, int4
from model.quant.quantized import Fused, QuantizedTensor

GEMV_ROWS = 8  # activation rows dequant_gemv takes; more go through the scratch tiles and the GEMM
BLOCK_ROWS, BLOCK_WARPS = 8, 4  # a dequant_gemv block's activation rows and weight rows: the .cu's
TILE_VALUES = 1 << 26  # weight values a scratch tile holds (128 MB of bf16): an 8B's projections in one or two
THREADS = 128
NULL = np.uint64(0)  # a null pointer argument, as cuda_ops passes one

log = logging.getLogger("spool.model")


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A GGUF tensor's block rows on the device, in Hugging Face's row order."""

    kind: str  # a PACKED_TYPES name: q4_k, q6_k...
    blocks: object  # (rows, row_bytes) uint8, on the device
    shape: tuple[int, int]  # (rows, columns) of the values

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def packed(ops, w):
    """w kept packed on the ops' device, or None where nothing of it can be: a QuantizedTensor of
    a PACKED_TYPES kind, or a Fused with such a part (its other parts in the storage type)."""
    if isinstance(w, QuantizedTensor) and w.kind in PACKED_TYPES:
        return PackedWeight(w.kind, ops.xp.asarray(np.ascontiguousarray(w.blocks)), w.shape)
    if isinstance(w, QuantizedTensor):
        ops.unpacked.add(w.kind)
    if isinstance(w, Fused) and any(isinstance(p, QuantizedTensor) and p.kind in PACKED_TYPES for p in w.parts):
        return Fused(tuple(ops.weight(p) for p in w.parts))
    return None


def loaded(ops) -> None:
    """One line for the whole model naming the GGUF types that were dequantized, not kept packed."""
    if ops.unpacked:
        log.info(f"GGUF types {', '.join(sorted(ops.unpacked))} have no packed kernels on the GPU; dequantized to"
                 f" {ops.dtype}")
        ops.unpacked.clear()


def is_packed(w) -> bool:
    """Whether w is what packed() made (CudaOps keeps no other Fused: it stacks float parts)."""
    return isinstance(w, (PackedWeight, Fused))


def linear(ops, x, w, bias, out) -> None:
    """out = x @ w.T (+ bias) for any weight CudaOps keeps, out in the storage type or fp32 (logits):
    the launcher's GEMM for a plain one; part by part into their columns of out for a packed one."""
    if not is_packed(w):
        ops.launcher.linear(x, w, bias, out)
        return
    parts, first = w.parts if isinstance(w, Fused) else (w,), 0
    for part in parts:
        if isinstance(part, PackedWeight) and x.shape[0] <= GEMV_ROWS:
            gemv(ops, out, x, part, None if bias is None else bias[first:first + part.shape[0]], first)
        else:
            for start, tile in tiles(ops, part):
                rows = slice(first + start, first + start + tile.shape[0])
                tile_bias = None if bias is None else bias[rows]
                if tile.shape[0] == out.shape[1]:  # the whole weight: straight into out
                    ops.launcher.linear(x, tile, tile_bias, out)
                else:
                    part_out = ops.xp.empty((x.shape[0], tile.shape[0]), dtype=out.dtype)
                    ops.launcher.linear(x, tile, tile_bias, part_out)
                    out[:, rows] = part_out
        first += part.shape[0]


def gemv(ops, out, x, w: PackedWeight, bias, first: int) -> None:
    """dequant_gemv into columns first .. first + rows of w of out."""
    (rows, k), n = x.shape, w.shape[0]
    if not rows:  # a grid of no blocks is an invalid launch on a GPU
        return
    fp32 = int(out.dtype != ops.storage_dtype)  # logits of 16-bit weights
    ops.kernel("dequant_gemv.cu", "dequant_gemv", (w.kind.upper(), fp32))(
        (-(-n // BLOCK_WARPS), -(-rows // BLOCK_ROWS)), (THREADS,),
        (out, x, w.blocks, NULL if bias is None else bias, np.int32(rows), np.int32(n), np.int32(k),
         np.int32(out.shape[1]), np.int32(first)))


def tiles(ops, w):
    """(first row, rows of w in the storage type) for tiles of at most TILE_VALUES values: a packed
    weight dequantized into scratch, a plain one's own rows."""
    step = max(1, TILE_VALUES // w.shape[1])
    for start in range(0, w.shape[0], step):
        count = min(step, w.shape[0] - start)
        yield start, dequantize_rows(ops, w, start, count) if isinstance(w, PackedWeight) else w[start:start + count]


def dequantize_rows(ops, w: PackedWeight, first: int, count: int, ids=None, scale: float = 1.0):
    """Rows first .. first + count of w, or its rows ids (zeros for an id outside it), in the
    storage type, times scale."""
    k = w.shape[1]
    out = ops.xp.empty((count, k), dtype=ops.storage_dtype)
    if count:
        ops.kernel("dequant_gemv.cu", "dequant_rows", (w.kind.upper(),))((count,), (THREADS,), (
            out, w.blocks, NULL if ids is None else ids, np.int32(w.shape[0]), np.int32(k), np.int32(first),
            np.float32(scale)))
    return out


def embedding(ops, table: PackedWeight, token_ids, scale: float = 1.0):
    """The embedding gather from packed rows (Gemma's scale applied before rounding)."""
    ids = ops.xp.ascontiguousarray(token_ids, dtype=np.int32)
    return dequantize_rows(ops, table, 0, ids.shape[0], ids, scale)


def dense(ops, w):
    """w whole in the storage type, for kernels that read only that (the MoE's grouped GEMM): a
    packed weight dequantized into scratch for the call (every expert of a layer: correct, not fast;
    a grouped GEMV over the packed experts is still to come)."""
    if not is_packed(w):
        return w
    parts = w.parts if isinstance(w, Fused) else (w,)
    return ops.xp.concatenate([dequantize_rows(ops, p, 0, p.shape[0]) if isinstance(p, PackedWeight) else p
                               for p in parts])


def device_bytes(kind: str, shape, dtype: str) -> int:
    """What CudaOps keeps of a tensor of a GGUF type, int4 or e4m3 kind (lower case, or a float
    type's name) on the device: a packed type's blocks, anything else's values in the storage type."""
    values = math.prod(shape)
    if kind not in PACKED_TYPES:
        return values * np.dtype(ARRAY_DTYPES[dtype]).itemsize
    for blocks in (int4, e4m3):
        if kind in blocks.KINDS:
            return values // blocks.KINDS[kind] * blocks.block_bytes(kind)
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.upper()]]
    return values // block * size
