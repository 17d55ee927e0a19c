"""Float32 weights into packed strips: Q8_0 by rounding, Q4_1 only where a weight is exactly
that, and the choice between them (compress) by what the CPU runs."""

import numpy as np
from numba import njit, prange

from model.quant.strips import BLOCK, STRIP, Q4_1Strips, Q8_0Strips, Strips


def quantizable(w: np.ndarray) -> bool:
    return w.ndim == 2 and w.shape[1] % BLOCK == 0


def quantize(w: np.ndarray) -> Q8_0Strips:
    """Round to nearest, each block scaled so that its largest magnitude is 127."""
    strips = Q8_0Strips.zeros(*w.shape)
    _quantize_strips(np.ascontiguousarray(w, dtype=np.float32), strips.q, strips.factors)
    return strips


def exact_q4_1(w: np.ndarray) -> Q4_1Strips | None:
    """w as Q4_1 blocks if it is exactly that: every block of 32 is minimum + scale x q, q in
    0..15, as llama.cpp's Q4_1 (whose blocks span q = 0 to 15) dequantizes to float32. The
    default model's projections come so from its GGUF: kept in 4 bits they lose nothing, where
    Q8_0 would round them again, and a step reads 40% fewer bytes. None for anything else."""
    strips = Q4_1Strips.zeros(*w.shape)
    exact = np.zeros(strips.q.shape[0], dtype=np.bool_)
    _pack_q4_1_strips(np.ascontiguousarray(w, dtype=np.float32), strips.q.view(np.uint8), strips.factors, exact)
    return strips if exact.all() else None


def compress(w: np.ndarray) -> Strips:
    """Q4_1 where w is exactly that (fewer bytes, nothing rounded again); else Q8_0."""
    return exact_q4_1(w) or quantize(w)


# Start-up runs these on every weight (135M numbers for the default model), once each: one pass
# on all cores, where NumPy took 2.3 s over its temporaries. No fastmath: the rounding must be
# NumPy's (float32 throughout, ties to even), and the Q4_1 test exact.
@njit("void(float32[:, ::1], int8[:, :, ::1], float32[:, :, ::1])", parallel=True, cache=True, nogil=True)
def _quantize_strips(w, q, scale):
    """Q8_0: row r, weight k of a block goes to line k // 2, byte 2r + k % 2 (the strip order)."""
    rows, blocks = w.shape[0], q.shape[1]
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            row = s * STRIP + r
            for b in range(blocks):
                values = w[row, b * BLOCK:(b + 1) * BLOCK]
                step = np.abs(values).max() / np.float32(127)
                scale[s, b, r] = step
                if step == 0:
                    step = np.float32(1)
                for k in range(BLOCK):
                    q[s, b, (k // 2) * 2 * STRIP + 2 * r + k % 2] = np.int8(np.rint(values[k] / step))


@njit(cache=True, nogil=True)
def _pack_q4_1_strip(w, q, factors, s):
    """Strip s as Q4_1 if each block of its rows is exactly minimum + scale x (0..15); False at
    the first value that is not. Lines as Q8_0's, two to a byte (line 2p in the low nibble,
    2p + 1 in the high one); factors are the 16 rows' scales, then their minima."""
    for r in range(min(STRIP, w.shape[0] - s * STRIP)):
        row = s * STRIP + r
        for b in range(q.shape[1]):
            values = w[row, b * BLOCK:(b + 1) * BLOCK]
            low, high = values.min(), values.max()
            step = (high - low) / np.float32(15)
            factors[s, b, r], factors[s, b, STRIP + r] = step, low
            divisor = step if step > 0 else np.float32(1)
            for k in range(BLOCK):
                level = np.rint((values[k] - low) / divisor)
                if not (level <= 15 and level * step + low == values[k]):
                    return False
                q[s, b, (k // 4) * 2 * STRIP + 2 * r + k % 2] |= np.uint8(level) << np.uint8(4 * (k // 2 % 2))
    return True


@njit("void(float32[:, ::1], uint8[:, :, ::1], float32[:, :, ::1], boolean[::1])", parallel=True, cache=True,
      nogil=True)
def _pack_q4_1_strips(w, q, factors, exact):
    """exact[s]: whether strip s's rows are Q4_1, packed where they are (_pack_q4_1_strip)."""
    for s in prange(q.shape[0]):
        exact[s] = _pack_q4_1_strip(w, q, factors, s)
