"""Every CUDA kernel against its NumPy twin, through the CPU harness (no GPU needed): fresh random
inputs at several shapes, outputs poisoned with NaN first so an element left unwritten fails.
Tolerances: float32 kernels match to float32 rounding (1e-5 relative); in float16 and bfloat16
the kernel rounds its output once from fp32, so it may differ from the reference rounded the
same way by one unit in the last place of the storage type."""

import numpy as np
import pytest

from cuda_harness import CpuModule, as_float, poisoned, storage
from model.ops import numpy_ops
from model.ops.kernels import name_expression

DTYPES = ["float32", "float16", "bfloat16"]
ULP = {"float32": 1e-5, "float16": 2 ** -10, "bfloat16": 2 ** -7}

modules: dict = {}


def kernel(file: str, name: str, dtype: str):
    if file not in modules:
        modules[file] = CpuModule(file)
    return modules[file].get_function(name_expression(name, dtype))


def assert_close(got, want, dtype, scale=1.0):
    got, want = as_float(got, dtype), np.asarray(want, dtype=np.float32)
    assert not np.isnan(got).any(), "the kernel left elements unwritten"
    tol = ULP[dtype] * (np.abs(want) + scale * 1e-3) * (1 if dtype == "float32" else 2)
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; worst {np.abs(got - want).max()}"


def rounded(x, dtype):
    """x as the kernel's inputs see it: rounded to the storage type, back in float32."""
    return as_float(storage(x, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 100), (5, 576)])
def test_rms_norm(dtype, rows, hidden):
    rng = np.random.default_rng(rows * hidden)
    x, w = rng.standard_normal((rows, hidden)) * 3, rng.standard_normal(hidden)
    xs, ws = storage(x, dtype), storage(w, dtype)
    out = poisoned((rows, hidden), dtype)
    kernel("rms_norm.cu", "rms_norm", dtype)((rows,), (128,), (out, xs, ws, np.int32(hidden), np.float32(1e-5)))
    want = numpy_ops.rms_norm(rounded(x, dtype), rounded(w, dtype), 1e-5)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(2, 64), (4, 200)])
def test_add_rms_norm_writes_the_sum_and_the_norm(dtype, rows, hidden):
    rng = np.random.default_rng(hidden)
    x, res, w = (rng.standard_normal((rows, hidden)), rng.standard_normal((rows, hidden)),
                 rng.standard_normal(hidden))
    xs, residual, ws = storage(x, dtype), storage(res, dtype), storage(w, dtype)
    out = poisoned((rows, hidden), dtype)
    kernel("rms_norm.cu", "add_rms_norm", dtype)((rows,), (64,), (out, residual, xs, ws, np.int32(hidden),
                                                                   np.float32(1e-6)))
    summed = rounded(rounded(res, dtype) + rounded(x, dtype), dtype)
    assert_close(residual, summed, dtype)
    assert_close(out, numpy_ops.rms_norm(summed, rounded(w, dtype), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 32), (3, 100), (7, 1536)])
def test_silu_and_mul(dtype, tokens, inter):
    rng = np.random.default_rng(inter)
    gate_up = rng.standard_normal((tokens, 2 * inter)) * 4
    out = poisoned((tokens, inter), dtype)
    block = 128
    kernel("activation.cu", "silu_and_mul", dtype)(((inter + block - 1) // block, tokens), (block,),
                                                   (out, storage(gate_up, dtype), np.int32(inter)))
    assert_close(out, numpy_ops.silu_and_mul(rounded(gate_up, dtype)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_gather(dtype):
    rng = np.random.default_rng(1)
    table = storage(rng.standard_normal((50, 72)), dtype)
    ids = rng.integers(0, 50, size=9).astype(np.int32)
    out = poisoned((9, 72), dtype)
    kernel("embedding.cu", "embedding", dtype)((9,), (64,), (out, table, ids, np.int32(72)))
    assert np.array_equal(out, table[ids])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4 and 8
def test_rotary_in_place_on_q_and_k(dtype, q_heads, kv_heads):
    rng = np.random.default_rng(q_heads)
    tokens, head_dim = 5, 64
    q, k = rng.standard_normal((tokens, q_heads, head_dim)), rng.standard_normal((tokens, kv_heads, head_dim))
    angles = rng.uniform(0, 50, (tokens, head_dim // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    qs, ks = storage(q, dtype), storage(k, dtype)
    kernel("rotary.cu", "rotary", dtype)((tokens,), (128,), (qs, ks, cos, sin, np.int32(q_heads), np.int32(kv_heads),
                                                             np.int32(head_dim)))
    assert_close(qs, numpy_ops.rope(rounded(q, dtype), cos, sin), dtype)
    assert_close(ks, numpy_ops.rope(rounded(k, dtype), cos, sin), dtype)
