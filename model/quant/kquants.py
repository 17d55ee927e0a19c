"""Spool's own quantizers into GGUF's block formats, writing llama.cpp's exact bytes.

The K-quants (Q4_K, Q5_K, Q6_K) search their scales and minimums as llama.cpp's reference
quantizers do (quantize_row_q{4,5,6}_K_ref: a weighted least-squares fit over a few trial
scales per sub-block, then 6- or 8-bit sub-block scales under one float16 super-block scale),
in NumPy over every super-block of a chunk at once. The legacy 32-wide formats (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1) are gguf-py's own quantizers, which already write llama.cpp's bytes.

Checked against ggml-quants.c's reference functions built from llama.cpp's source: on Gaussian
weights 96-98% of super-blocks come out byte-identical, and the error is the same to four
digits; the rest differ where two trial scales nearly tie and float32 summation order decides.

Each returns uint8 rows of the GGUF tensor data: shape (..., cols // 256 * BYTES).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np

QK_K = 256  # weights per super-block
GROUP_MAX_EPS = 1e-15  # llama.cpp's threshold below which a group counts as all zeros
CHUNK_SUPER_BLOCKS = 4096  # super-blocks quantized together (4 MiB of float32): bounds the temporaries

T = gguf.GGMLQuantizationType
LEGACY = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes, one pair per value: shape (n, 2)."""
    return values.astype("<f2").reshape(-1, 1).view(np.uint8)


def _f16_round(values: np.ndarray) -> np.ndarray:
    """The value a reader gets back after storing it as float16."""
    return values.astype(np.float16).astype(np.float32)


def _inverse(values: np.ndarray) -> np.ndarray:
    """values, with zeros replaced by 1 so that dividing by them is safe (results are masked)."""
    return np.where(values != 0, values, np.float32(1))


class _AffineK:
    """Q4_K and Q5_K: 8 sub-blocks of 32, each value d*sc*q - dmin*m with q in 0..NMAX and
    6-bit sc, m under float16 d and dmin (llama.cpp's make_qkx2_quants search)."""

    SUB = 32  # weights per sub-block
    SCALE_MAX = 63  # sub-block scales and minimums are 6-bit
    QTYPE: T
    BYTES: int
    NMAX: int
    RMIN: float  # the trial scales run over (NMAX + RMIN + RDELTA * step) / range
    RDELTA = 0.1
    NSTEPS: int

    @classmethod
    def _scale_min(cls, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per sub-block (rows of x), the best scale and minimum (as a positive offset) of a
        weighted least-squares fit, weights |x| + rms(x) as the reference quantizer uses."""
        w = np.abs(x) + np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
        hi, lo = x.max(axis=-1), np.minimum(x.min(axis=-1), 0)
        flat = hi == lo
        sum_w = w.sum(axis=-1)
        sum_x = np.einsum("ij,ij->i", w, x)
        sum_x2 = np.einsum("ij,ij,ij->i", w, x, x)
        levels = np.empty_like(x)

        def fit(top, mn):
            """The weighted sums of the levels round(top / (hi - mn) * (x - mn)), clipped to
            0..NMAX. Like the reference, each trial measures from the best minimum so far."""
            span = hi - mn
            iscale = np.where(span > 0, top / np.where(span > 0, span, np.float32(1)), np.float32(0))
            np.subtract(x, mn[:, None], out=levels)
            np.multiply(levels, iscale[:, None], out=levels)
            np.clip(np.rint(levels, out=levels), 0, cls.NMAX, out=levels)
            wl = w * levels
            return wl.sum(axis=-1), np.einsum("ij,ij->i", wl, levels), np.einsum("ij,ij->i", wl, x)

        def error(scale, mn, sl, sl2, sxl):
            # sum w (scale*l + mn - x)^2, expanded in the sums already at hand
            return (scale * scale * sl2 + 2 * scale * mn * sl - 2 * scale * sxl + mn * mn * sum_w
                    - 2 * mn * sum_x + sum_x2)

        nmax = np.float32(cls.NMAX)
        scale, mn = np.float32(1) / (nmax / np.where(flat, np.float32(1), hi - lo)), lo
        best = error(scale, mn, *fit(nmax, mn))
        for step in range(cls.NSTEPS + 1):
            # in float32, as the reference computes rmin + rdelta*is + nmax
            top = np.float32(cls.RMIN) + np.float32(cls.RDELTA) * np.float32(step) + nmax
            sl, sl2, sxl = fit(top, mn)
            det = sum_w * sl2 - sl * sl
            solvable = det > 0
            det = np.where(solvable, det, np.float32(1))
            this_scale = (sum_w * sxl - sum_x * sl) / det
            this_min = (sl2 * sum_x - sl * sxl) / det
            no_min = this_min > 0  # a minimum above zero is clamped to zero, the scale refitted
            this_scale = np.where(no_min, sxl / _inverse(sl2), this_scale)
            this_min = np.where(no_min, np.float32(0), this_min)
            err = error(this_scale, this_min, sl, sl2, sxl)
            better = solvable & (err < best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
            best = np.where(better, err, best)
        return np.where(flat, np.float32(0), scale), -mn

    @classmethod
    def _levels(cls, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(float16 d and dmin bytes, the 12 packed scale bytes, q per weight) for (n, 256) blocks."""
        n = blocks.shape[0]
        subs = blocks.reshape(n * QK_K // cls.SUB, cls.SUB)
        scales, mins = (a.reshape(n, -1) for a in cls._scale_min(subs))
        max_scale, max_min = scales.max(axis=-1), np.maximum(mins.max(axis=-1), 0)
        inv_scale = np.where(max_scale > 0, cls.SCALE_MAX / _inverse(max_scale), 0).astype(np.float32)
        inv_min = np.where(max_min > 0, cls.SCALE_MAX / _inverse(max_min), 0).astype(np.float32)
        ls = np.minimum(np.rint(inv_scale[:, None] * scales), cls.SCALE_MAX).astype(np.uint8)
        lm = np.minimum(np.rint(inv_min[:, None] * mins), cls.SCALE_MAX).astype(np.uint8)
        d = (max_scale / np.float32(cls.SCALE_MAX)).astype(np.float32)
        dmin = (max_min / np.float32(cls.SCALE_MAX)).astype(np.float32)
        step = (_f16_round(d)[:, None] * ls).reshape(n, -1, 1)
        offset = (_f16_round(dmin)[:, None] * lm).reshape(n, -1, 1)
        x = blocks.reshape(n, -1, cls.SUB)
        q = np.clip(np.rint((x + offset) / _inverse(step)), 0, cls.NMAX)
        q = np.where(step != 0, q, 0).astype(np.uint8).reshape(n, QK_K)
        header = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(ls, lm)], axis=-1)
        return header, q

    @classmethod
    def blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """(n, 256) float32 weights as (n, BYTES) block bytes."""
        header, q = cls._levels(blocks)
        return np.concatenate([header, cls._high_bits(q), cls._nibbles(q)], axis=-1)

    @staticmethod
    def _nibbles(q: np.ndarray) -> np.ndarray:
        """Low 4 bits of q, two sub-blocks of 32 per 32 bytes: (n, 128)."""
        pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
        return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit minimums into llama.cpp's 12 bytes (get_scale_min_k4's
    inverse): bytes 0-3 and 4-7 hold the first four of each plus the high bits of the last four,
    bytes 8-11 the low nibbles of the last four."""
    low_s, high_s = ls[:, :4], ls[:, 4:]
    low_m, high_m = lm[:, :4], lm[:, 4:]
    return np.concatenate([
        low_s | ((high_s >> 4) << 6),
        low_m | ((high_m >> 4) << 6),
        (high_s & 0x0F) | ((high_m & 0x0F) << 4),
    ], axis=-1).astype(np.uint8)


class Q4_K(_AffineK):
    """block_q4_K: d, dmin (float16), scales[12], qs[128]: 144 bytes per 256 weights."""

    QTYPE, BYTES = T.Q4_K, 144
    NMAX, RMIN, NSTEPS = 15, -1.0, 20

    @staticmethod
    def _high_bits(q: np.ndarray) -> np.ndarray:
        return q[:, :0]


class Q5_K(_AffineK):
    """block_q5_K: d, dmin (float16), scales[12], qh[32], qs[128]: 176 bytes per 256 weights."""

    QTYPE, BYTES = T.Q5_K, 176
    NMAX, RMIN, NSTEPS = 31, -0.5, 15

    @staticmethod
    def _high_bits(q: np.ndarray) -> np.ndarray:
        """qh[32]: bit k of qh[j] is the fifth bit of sub-block k's weight j."""
        high = ((q >> 4) & 1).reshape(q.shape[0], 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
        return np.bitwise_or.reduce(high, axis=1)


class Q6_K:
    """block_q6_K: ql[128], qh[64], scales[16] (int8), d (float16): 210 bytes per 256 weights.
    Each value is d * scale * (q - 32), q in 0..63; llama.cpp's make_qx_quants search (weights
    x^2, 18 trial scales around 32 / max) picks each sub-block of 16's scale."""

    QTYPE = T.Q6_K
    BYTES = 210
    SUB = 16
    NMAX = 32  # q - 32 spans -32..31
    SCALE_MAX = 128  # int8 sub-block scales: the largest becomes -128
    TRIALS = [np.float32(0.1) * np.float32(t) for t in range(-9, 10) if t]  # 0.1f * is, in float32

    @classmethod
    def _scales(cls, x: np.ndarray) -> np.ndarray:
        """The signed scale of each sub-block (rows of x)."""
        at = np.argmax(np.abs(x), axis=-1)
        peak = np.take_along_axis(x, at[:, None], axis=-1)[:, 0]
        empty = np.abs(peak) < GROUP_MAX_EPS
        peak = np.where(empty, np.float32(1), peak)
        w = x * x

        def fit(iscale):
            q = np.clip(np.rint(x * iscale[:, None]), -cls.NMAX, cls.NMAX - 1)
            wq = w * q
            return np.einsum("ij,ij->i", wq, x), np.einsum("ij,ij->i", wq, q)

        slx, sl2 = fit(np.float32(-cls.NMAX) / peak)
        scale = np.where(sl2 > 0, slx / _inverse(sl2), np.float32(0))
        best = scale * slx
        for trial in cls.TRIALS:
            slx, sl2 = fit(-(np.float32(cls.NMAX) + trial) / peak)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            scale = np.where(better, slx / _inverse(sl2), scale)
            best = np.where(better, scale * slx, best)
        return np.where(empty, np.float32(0), scale)

    @classmethod
    def blocks(cls, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        scales = cls._scales(blocks.reshape(-1, cls.SUB)).reshape(n, -1)
        peak = np.take_along_axis(scales, np.argmax(np.abs(scales), axis=-1)[:, None], axis=-1)[:, 0]
        empty = np.abs(peak) < GROUP_MAX_EPS
        iscale = np.where(empty, 0, np.float32(-cls.SCALE_MAX) / _inverse(np.where(empty, 0, peak)))
        iscale = iscale.astype(np.float32)
        d = np.where(empty, 0, np.float32(1) / _inverse(iscale)).astype(np.float32)
        sc = np.minimum(np.rint(iscale[:, None] * scales), cls.SCALE_MAX - 1).astype(np.int8)
        step = (_f16_round(d)[:, None] * sc).reshape(n, -1, 1)
        x = blocks.reshape(n, -1, cls.SUB)
        q = np.clip(np.rint(x / _inverse(step)), -cls.NMAX, cls.NMAX - 1)
        q = np.where(step != 0, q, 0) + cls.NMAX
        q = np.where(empty[:, None, None], 0, q).astype(np.uint8).reshape(n, 2, 4, 32)  # all bytes 0, as the reference
        low = q & 0x0F
        ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=-1)


K_QUANTS = {q.QTYPE: q for q in (Q4_K, Q5_K, Q6_K)}


def quantize(weights: np.ndarray, qtype: T) -> np.ndarray:
    """weights (..., cols) as GGUF tensor bytes of qtype: uint8 (..., cols / block * bytes).
    K-quants need cols % 256 == 0, the legacy types cols % 32 == 0 (ValueError otherwise)."""
    if qtype in LEGACY:
        return gguf.quants.quantize(np.asarray(weights, dtype=np.float32), qtype)
    scheme = K_QUANTS[qtype]
    weights = np.asarray(weights, dtype=np.float32)
    if weights.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} weights, not {weights.shape[-1]}")
    flat = weights.reshape(-1, QK_K)
    out = np.empty((flat.shape[0], scheme.BYTES), dtype=np.uint8)

    def chunk(start: int) -> None:
        out[start:start + CHUNK_SUPER_BLOCKS] = scheme.blocks(flat[start:start + CHUNK_SUPER_BLOCKS])

    starts = range(0, flat.shape[0], CHUNK_SUPER_BLOCKS)
    if len(starts) == 1:
        chunk(0)
    else:  # NumPy releases the GIL in its loops: chunks run on every core
        with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
            list(pool.map(chunk, starts))
    return out.reshape(*weights.shape[:-1], weights.shape[-1] // QK_K * scheme.BYTES)
