"""x @ w.T for packed weights: the integer GEMV (model/quant/gemv.py) for every row count on
every CPU, so that a row's output is the same bits whatever else is in the step.

The GEMV outran OpenBLAS over weights widened to float32 a slab at a time at every size measured
(64 to 512 rows of 2048 -> 3072, 2048 -> 16384 and 8192 -> 2048: 0.1-0.6x their time on a
2-core AVX-512 EPYC), and AMX's bfloat16 GEMM, which took the rows above 32 before, cannot give
the GEMV's bits; AMX's int8 tiles can, and the GEMV takes 16 rows at a time through them where
the CPU has them (model/quant/tiles.py).
"""

import numpy as np

from model.quant.gemv import gemv
from model.quant.strips import STRIP, Strips


def matmul(x: np.ndarray, w: Strips | tuple[Strips, ...], activations=np.int8) -> np.ndarray:
    """x @ w.T for activations x (tokens, in), as float32 (tokens, out), x's blocks rounded to
    activations (np.int8 or np.int16, gemv.py); w packed weights, or parts of one stacked along
    their rows."""
    parts = w if isinstance(w, tuple) else (w,)
    out = gemv(np.ascontiguousarray(x, dtype=np.float32), parts, activations)
    if any(p.rows % STRIP for p in parts[:-1]):  # a part's zero rows sit before the next part's
        firsts = np.cumsum([0] + [p.q.shape[0] * STRIP for p in parts[:-1]])
        return np.concatenate([out[:, f:f + p.rows] for f, p in zip(firsts, parts)], axis=1)
    rows = sum(p.rows for p in parts)
    return out if rows == out.shape[1] else np.ascontiguousarray(out[:, :rows])
