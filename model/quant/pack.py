"""Float32 weights into packed strips, by the --dtype asked (compress): Q8_0 by rounding, Q4_1
only where a weight is exactly that, and Q4_K by Spool's own quantizer (kquants.py, llama.cpp's
bytes) packed as a GGUF's Q4_K is (kblocks.py). A weight may come unread (FloatRows: an
embedding, an LM head), and is then packed a slab of rows at a time."""

from typing import Callable

import gguf
import numpy as np
from numba import njit, prange

from model.errors import ModelError
from model.quant import kblocks, kquants
from model.quant.quantized import FloatRows
from model.quant.strips import BLOCK, STRIP, Q4_1Strips, Q4_KStrips, Q8_0Strips, Strips

KINDS = ("q8_0", "q4_k")  # what compress makes of float weights


def quantizable(w) -> bool:
    return len(w.shape) == 2 and w.shape[1] % BLOCK == 0


def quantize(w: np.ndarray) -> Q8_0Strips:
    """Round to nearest, each block's scale its largest magnitude over 127 rounded up to a
    float16 (as llama.cpp keeps it; up, so that no value passes 127)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    scales = _float16_at_least(np.maximum(blocks.max(axis=2), -blocks.min(axis=2)) / np.float32(127))
    strips = Q8_0Strips.zeros(*w.shape)
    _quantize_strips(w, scales.astype(np.float32), scales.view(np.uint16), *strips.packed_arrays())
    return strips


def _float16_at_least(x: np.ndarray) -> np.ndarray:
    """The least float16 at or above each (non-negative) float32; a weight no float16 scale can
    hold (a block past 8 million) is refused."""
    with np.errstate(over="ignore"):
        halves = x.astype(np.float16)
    below = halves.astype(np.float32) < x
    halves[below] = np.nextafter(halves[below], np.float16(np.inf))
    if not np.isfinite(halves).all():
        raise ModelError("a weight's values pass the range of Q8_0's float16 scales; run with --dtype float32")
    return halves


def exact_q4_1(w: np.ndarray) -> Q4_1Strips | None:
    """w as Q4_1 blocks if it is exactly that: every block of 32 is minimum + scale x q, q in
    0..15, as llama.cpp's Q4_1 (whose blocks span q = 0 to 15, scale and minimum float16)
    dequantizes to float32. The default model's projections come so from its GGUF: kept in 4
    bits they lose nothing, where Q8_0 would round them again, and a step reads 40% fewer
    bytes. None for anything else."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    low = blocks.min(axis=2)
    step = (blocks.max(axis=2) - low) / np.float32(15)
    with np.errstate(over="ignore"):
        halves = step.astype(np.float16), low.astype(np.float16)
    if any((h.astype(np.float32) != f).any() for h, f in zip(halves, (step, low))):
        return None
    strips = Q4_1Strips.zeros(*w.shape)
    exact = np.zeros(strips.q.shape[0], dtype=np.bool_)
    _pack_q4_1_strips(w, step, low, *(h.view(np.uint16) for h in halves), *strips.packed_arrays(), exact)
    return strips if exact.all() else None


def quantize_q4_k(w: np.ndarray) -> Q4_KStrips:
    """Q4_K as llama.cpp's reference quantizer writes it (kquants.Q4_K), in Q4_KStrips: what a
    GGUF's Q4_K tensor of these values would serve as. Rows of a multiple of 256 weights."""
    return kblocks.pack_q4_k(kquants.quantize(w, gguf.GGMLQuantizationType.Q4_K), w.shape[1])


def compress(w: np.ndarray | FloatRows, kind: str = "q8_0") -> Strips:
    """kind q8_0: Q4_1 where w is exactly that (fewer bytes, nothing rounded again), else Q8_0.
    q4_k: Q4_K where its rows split into super-blocks of 256 weights; a weight whose rows do not
    (an in-dimension not a multiple of 256) falls back to q8_0's choice."""
    if kind == "q4_k" and w.shape[1] % kquants.QK_K == 0:
        return in_slabs(w, quantize_q4_k)
    return in_slabs(w, exact_q4_1) or in_slabs(w, quantize)


def in_slabs(w: np.ndarray | FloatRows, pack: Callable[[np.ndarray], Strips | None]) -> Strips | None:
    """pack(w), for FloatRows a slab of rows at a time (slabs are whole strips), the slabs' strips
    copied into one; None where pack gives None for any slab."""
    if not isinstance(w, FloatRows):
        return pack(w)
    whole = None
    for first, part in w.slabs():
        packed = pack(part)
        if packed is None:
            return None
        if whole is None:
            whole = type(packed).zeros(*w.shape)
        at = first // STRIP
        whole.q[at:at + packed.q.shape[0]] = packed.q
        whole.factors[at:at + packed.q.shape[0]] = packed.factors
    return whole


# Start-up runs these on every weight (135M numbers for the default model), once each: one pass
# on all cores, where NumPy took 2.3 s over its temporaries (the blocks' scales, a 32nd of the
# values, come from NumPy before). No fastmath: the rounding must be NumPy's (float32
# throughout, ties to even), and the Q4_1 test exact.
@njit("void(float32[:, ::1], float32[:, ::1], uint16[:, ::1], uint8[:, :, ::1], uint16[:, :, ::1])", parallel=True,
      cache=True, nogil=True)
def _quantize_strips(w, scales, scale_bits, q, factors):
    """Q8_0: row r, weight k of a block to its place in the strip (kblocks.put_byte), divided by
    the block's scale (scales, as float32 and as float16 bits)."""
    rows, blocks = w.shape[0], q.shape[1]
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            row = s * STRIP + r
            for b in range(blocks):
                factors[s, b, r] = scale_bits[row, b]
                step = scales[row, b] if scales[row, b] > 0 else np.float32(1)
                for k in range(BLOCK):
                    kblocks.put_byte(q, s, b, r, k, np.int8(np.rint(w[row, b * BLOCK + k] / step)))


@njit(cache=True, nogil=True)
def _pack_q4_1_strip(w, step, low, step_bits, low_bits, q, factors, s):
    """Strip s as Q4_1 if each block of its rows is exactly low + step x (0..15); False at the
    first value that is not (kblocks.put); factors are the 16 rows' scales, then their minima."""
    for r in range(min(STRIP, w.shape[0] - s * STRIP)):
        row = s * STRIP + r
        for b in range(q.shape[1]):
            factors[s, b, r], factors[s, b, STRIP + r] = step_bits[row, b], low_bits[row, b]
            scale, minimum = step[row, b], low[row, b]
            divisor = scale if scale > 0 else np.float32(1)
            for k in range(BLOCK):
                value = w[row, b * BLOCK + k]
                level = np.rint((value - minimum) / divisor)
                if not (level <= 15 and level * scale + minimum == value):
                    return False
                kblocks.put(q, s, b, r, k, np.uint8(level), 0)
    return True


@njit("void(float32[:, ::1], float32[:, ::1], float32[:, ::1], uint16[:, ::1], uint16[:, ::1], uint8[:, :, ::1],"
      " uint16[:, :, ::1], boolean[::1])", parallel=True, cache=True, nogil=True)
def _pack_q4_1_strips(w, step, low, step_bits, low_bits, q, factors, exact):
    """exact[s]: whether strip s's rows are Q4_1, packed where they are (_pack_q4_1_strip)."""
    for s in prange(q.shape[0]):
        exact[s] = _pack_q4_1_strip(w, step, low, step_bits, low_bits, q, factors, s)
