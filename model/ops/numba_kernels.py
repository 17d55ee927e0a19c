"""How the numba CPU kernels compile (each twice: on every core and on one), their signatures,
and what several kernel modules share: the float16 K/V type and a vectorising exponential.

Kernels compile once per machine and source (`cache=True`, into numba's cache, which
model/caches.py keys by the whole model package, so a change to exp_shifted here reaches the
kernels of other modules too) and run on all cores through `prange`; every kernel is compiled
for C-contiguous arrays when its module is imported (about 10 s the first time on a machine,
then read from the cache).
"""

import types

import numpy as np
from numba import njit

from model.quant.cpu import F16C

# K/V in float16, as llama.cpp keeps them by default: a decode step's attention reads half the
# bytes (at 64 rows of 256 tokens it reads more K/V than weights), and a cache of the same size
# holds twice the tokens. numba has no float16 type, so the cache holds the bit patterns and the
# kernels widen them (vcvtph2ps) as they read. A target without F16C (numba's `generic`,
# QEMU's kvm64) has no instruction for that and numba cannot link LLVM's routines for it: there
# the kernels are compiled for float32 K/V alone, and the q8_0 ops keep K/V in float32.
HALF = np.dtype(np.uint16)
QUANTIZED_KV = HALF if F16C else np.dtype(np.float32)

# Below this many elements of work an op runs on one core: waking the other costs more.
PARALLEL_WORK = 1 << 15
# fastmath without arcp: with it LLVM divides by an approximate reciprocal in one twin and not
# the other (SiLU's division, measured), so a row's result would depend on how much work shares
# its step.
FASTMATH = {"nnan", "ninf", "nsz", "contract", "reassoc", "afn"}


def kernel(*signatures: str):
    """The function compiled twice when the module loads, for C-contiguous arrays: on every
    core (prange splits) and on one (prange is range), to the same bits. The serial twin is a
    copy under another name: numba's cache keys on the name, not the flags. Signatures of float16 K/V
    (H4) are compiled only where the target converts float16 (F16C)."""
    signatures = [signature for signature in signatures if F16C or H4 not in signature]

    def compile_both(fn):
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                  fn.__closure__)
        twin.__qualname__ = fn.__qualname__ + "_serial"
        serial = njit(list(signatures), fastmath=FASTMATH, cache=True, nogil=True)(twin)
        parallel = njit(list(signatures), parallel=True, fastmath=FASTMATH, cache=True, nogil=True)(fn)

        def run(work: int, *args):
            return (parallel if work >= PARALLEL_WORK else serial)(*args)
        return run
    return compile_both


F1, F2, F3, F4, I1, I2 = "float32[::1]", "float32[:, ::1]", "float32[:, :, ::1]", "float32[:, :, :, ::1]", \
    "int64[::1]", "int64[:, ::1]"
H4 = "uint16[:, :, :, ::1]"  # a K/V cache of float16 bit patterns
B4 = "int8[:, :, :, ::1]"  # a q8_0 K/V cache: int8 values, each token's float32 scale inline (model/kv_cache.py)

LOG2E, LN2_HIGH, LN2_LOW = np.float32(1.4426950408889634), np.float32(0.693145751953125), \
    np.float32(1.428606765330187e-06)


@njit(inline="always", fastmath=FASTMATH)
def exp_shifted(x, top, count, powers):
    """x[k] = exp(x[k] - top) for k < count, returning their sum; powers (int32, count or more)
    is scratch. Plain arithmetic that vectorises, as numba's np.exp does not without Intel's
    SVML: Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, and 2^n through
    the exponent bits. Inputs are clamped to [-87, 88], so the result is a normal float (about
    1e-38 for anything below, 1.7e38 for anything above)."""
    for k in range(count):
        v = min(max(x[k] - top, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(v * LOG2E + np.float32(0.5))
        r = v - n * LN2_HIGH - n * LN2_LOW
        p = np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        x[k] = p * r + np.float32(1.0)
        powers[k] = (np.int32(n) + np.int32(127)) << np.int32(23)
    scale = powers.view(np.float32)
    total = np.float32(0.0)
    for k in range(count):
        x[k] *= scale[k]
        total += x[k]
    return total

