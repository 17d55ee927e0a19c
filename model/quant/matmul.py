"""x @ w.T for packed weights, by the number of activation rows and what the CPU has: the GEMV
up to GEMV_ROWS rows, above it the AMX GEMM (Q8_0 and Q4_1 strips), or OpenBLAS over widened
slabs without AMX (and for the other schemes)."""

import numpy as np

from model.quant.amx import amx_gemm
from model.quant.blas import blas_matmul
from model.quant.cpu import AMX, PMADDWD
from model.quant.gemv import float_gemv, pmaddwd_gemv
from model.quant.strips import Q4_1Strips, Q8_0Strips, Strips

GEMV_ROWS = 32  # up to this many activation rows, the GEMV; above, the GEMM


def matmul(x: np.ndarray, w: Strips) -> np.ndarray:
    """x @ w.T for activations x (tokens, in), as float32 (tokens, out)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[0] <= GEMV_ROWS:
        out = pmaddwd_gemv(x, w) if PMADDWD else float_gemv(x, w)
    elif AMX and isinstance(w, (Q8_0Strips, Q4_1Strips)):
        out = amx_gemm(x, w)
    else:
        out = blas_matmul(x, w)
    return out if w.rows == out.shape[1] else np.ascontiguousarray(out[:, :w.rows])
