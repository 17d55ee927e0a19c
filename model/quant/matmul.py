"""x @ w.T for packed weights, by what the CPU has: with AVX-512 the vpmaddwd GEMV for every
row count, so that a row's output is the same bits whatever else is in the step; on the
portable path the float32 GEMV up to GEMV_ROWS rows and OpenBLAS over widened slabs above.

The GEMV outran the slabs at every size measured (64 to 512 rows of 2048 -> 3072, 2048 -> 16384
and 8192 -> 2048: 0.1-0.6x their time on a 2-core AVX-512 EPYC), and AMX's bfloat16 GEMM, which
took the rows above 32 before, cannot give the GEMV's bits.
"""

import numpy as np

from model.quant.blas import blas_matmul
from model.quant.cpu import PMADDWD
from model.quant.gemv import float_gemv, pmaddwd_gemv
from model.quant.strips import Strips

GEMV_ROWS = 32  # the portable path: up to this many activation rows, the float32 GEMV; above, the slabs


def matmul(x: np.ndarray, w: Strips) -> np.ndarray:
    """x @ w.T for activations x (tokens, in), as float32 (tokens, out)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if PMADDWD:
        out = pmaddwd_gemv(x, w)
    elif x.shape[0] <= GEMV_ROWS:
        out = float_gemv(x, w)
    else:
        out = blas_matmul(x, w)
    return out if w.rows == out.shape[1] else np.ascontiguousarray(out[:, :w.rows])
