"""Spool's GGUF quantizers (model/quant/kquants.py) against gguf-py's own dequantizer."""

import gguf
import numpy as np
import pytest

from model.quant.kquants import QK_K, quantize

T = gguf.GGMLQuantizationType

# RMS error relative to the weights' RMS, on standard Gaussian weights. Measured over 1, 3 and
# 37 rows of 1024: Q4_K 0.071-0.075, Q5_K 0.036-0.037, Q6_K 0.018, Q8_0 0.0055, Q4_0 0.086,
# Q4_1 0.078-0.082, Q5_0 0.042-0.044, Q5_1 0.038-0.039; each bound sits a little above.
BOUNDS = {T.Q4_K: 0.078, T.Q5_K: 0.039, T.Q6_K: 0.019, T.Q8_0: 0.006,
          T.Q4_0: 0.09, T.Q4_1: 0.085, T.Q5_0: 0.046, T.Q5_1: 0.041}


def relative_rms(qtype, x):
    data = quantize(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8 and data.shape == (*x.shape[:-1], x.shape[-1] // block * size)
    y = gguf.quants.dequantize(data, qtype)
    assert y.shape == x.shape
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)))


@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_gaussian_weights_within_bound(qtype, rows):
    x = np.random.default_rng(rows).standard_normal((rows, 1024)).astype(np.float32)
    assert relative_rms(qtype, x) < BOUNDS[qtype]


def test_scale_search_beats_min_max():
    """Q4_K's fitted scales beat Q4_1's bare min/max at the same 4 bits per weight."""
    x = np.random.default_rng(7).standard_normal((64, 1024)).astype(np.float32)
    assert relative_rms(T.Q4_K, x) < 0.95 * relative_rms(T.Q4_1, x)


def test_three_dimensional_and_scaled_weights():
    x = np.random.default_rng(3).standard_normal((2, 5, 512)).astype(np.float32) * 0.02
    x[1] *= 50  # super-blocks of very different magnitudes side by side
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        assert relative_rms(qtype, x) < BOUNDS[qtype] * 1.05


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_zero_and_constant_blocks(qtype):
    x = np.zeros((3, QK_K), dtype=np.float32)
    x[1] = -0.5  # a constant block: all the weight in the minimum
    x[2, :32] = 1.0
    y = gguf.quants.dequantize(quantize(x, qtype), qtype)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0)
    tolerance = 0.5 / 31 if qtype == T.Q6_K else 1e-3  # Q6_K has no minimum: -0.5 on its grid
    np.testing.assert_allclose(y[1], -0.5, atol=tolerance)
    np.testing.assert_allclose(y[2], x[2], atol=1e-3)


def test_exact_grid_values_round_trip():
    """Weights already on a format's grid come back bit for bit."""
    rng = np.random.default_rng(1)
    q = rng.integers(-32, 32, (5, 16, 16))
    q[:, :, 0] = -32  # every sub-block reaches the largest magnitude
    x = (q * 2.0 ** -6).astype(np.float32).reshape(5, QK_K)
    np.testing.assert_array_equal(gguf.quants.dequantize(quantize(x, T.Q6_K), T.Q6_K), x)
    for qtype, nmax in ((T.Q4_K, 15), (T.Q5_K, 31)):
        q = rng.integers(0, nmax + 1, (5, 8, 32))
        q[:, :, 0], q[:, :, 1] = 0, nmax  # every sub-block spans the whole range
        d = 63 * 2.0 ** -10  # a float16 super-block scale times the largest 6-bit scale
        for offset in (0, 7):  # without and with a minimum
            x = ((q - offset) * d).astype(np.float32).reshape(5, QK_K)
            np.testing.assert_array_equal(gguf.quants.dequantize(quantize(x, qtype), qtype), x)


def test_rows_must_fill_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 320), dtype=np.float32), T.Q4_K)
