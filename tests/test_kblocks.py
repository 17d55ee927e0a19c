"""GGUF's K-quant and 5-bit tensors packed as they are (model/quant/kblocks.py): read back bit
for bit as gguf-py dequantizes them, and multiplied by the kernels as by NumPy."""

import gguf
import numpy as np
import pytest
from reference import int8_activations

from model.errors import ModelError
from model.quant import kblocks
from model.quant.kquants import quantize
from model.quant.matmul import matmul
from model.quant.blocks import pack_iq4_nl
from model.quant.strips import (IQ4_NLStrips, IQ4_XSStrips, Q2_KStrips, Q3_KStrips, Q4_1Strips, Q4_KStrips,
                                Q5_0Strips, Q5_1Strips, Q5_KStrips, Q6_KStrips)

T = gguf.GGMLQuantizationType
PACKERS = {T.Q4_K: (kblocks.pack_q4_k, Q4_KStrips), T.Q5_0: (kblocks.pack_q5_0, Q5_0Strips),
           T.Q5_1: (kblocks.pack_q5_1, Q5_1Strips), T.Q5_K: (kblocks.pack_q5_k, Q5_KStrips),
           T.Q6_K: (kblocks.pack_q6_k, Q6_KStrips), T.Q2_K: (kblocks.pack_q2_k, Q2_KStrips),
           T.Q3_K: (kblocks.pack_q3_k, Q3_KStrips),
           T.IQ4_NL: (pack_iq4_nl, IQ4_NLStrips), T.IQ4_XS: (kblocks.pack_iq4_xs, IQ4_XSStrips)}
SCALE_AT = {T.Q2_K: 80, T.Q3_K: 108, T.IQ4_NL: 0, T.IQ4_XS: 0}  # where a block's float16 d is, for types Spool does not write


def gguf_weight(qtype, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights as qtype's bytes (Spool's K-quantizers, gguf-py's for Q5_0 and Q5_1),
    rows of very different magnitudes and, from three rows, a zero row among them. Types Spool
    has no quantizer for get random blocks (every byte pattern is a valid block) under d of
    the same magnitudes."""
    rng = np.random.default_rng(seed)
    magnitudes = rng.choice([1e-3, 0.05, 3], rows)[:, None]
    if qtype in SCALE_AT:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
        d = (rng.standard_normal((rows, columns // block)) * magnitudes / 30).astype(np.float16)
        if rows >= 3:
            d[rows // 2] = 0
        data[..., SCALE_AT[qtype]:SCALE_AT[qtype] + 2] = d.view(np.uint8).reshape(rows, -1, 2)
        if qtype == T.Q2_K:  # and dmin
            data[..., 82:84] = (d * np.float16(0.7)).view(np.uint8).reshape(rows, -1, 2)
        return data.reshape(rows, -1)
    w = rng.standard_normal((rows, columns), dtype=np.float32) * magnitudes
    if rows >= 3:
        w[rows // 2] = 0
    return quantize(w.astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", list(PACKERS), ids=lambda t: t.name)
@pytest.mark.parametrize("rows, columns", [(1, 256), (17, 768), (100, 512)])
def test_packed_blocks_read_back_bit_for_bit(qtype, rows, columns):
    data = gguf_weight(qtype, rows, columns)
    data.setflags(write=False)  # as a memory-mapped file hands it over
    pack, scheme = PACKERS[qtype]
    strips = pack(data, columns)
    assert type(strips) is scheme and strips.shape == (rows, columns)
    want = gguf.quants.dequantize(data, qtype)
    np.testing.assert_array_equal(strips.dequantize().view(np.uint32), want.view(np.uint32))
    picked = np.array([rows - 1, 0, rows // 2])
    np.testing.assert_array_equal(strips.dequantize(picked).view(np.uint32), want[picked].view(np.uint32))


@pytest.mark.parametrize("qtype, bits", [(T.Q4_K, 4.625), (T.Q5_0, 5.5), (T.Q5_1, 6), (T.Q5_K, 5.625),
                                         (T.Q6_K, 6.625), (T.Q2_K, 5.25), (T.Q3_K, 4.625), (T.IQ4_NL, 4.5), (T.IQ4_XS, 4.3125)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_bits_a_weight_the_kernels_read(qtype, bits):
    """Values and factors, against the file's 4.5, 5.5, 6, 5.5, 6.5625, 2.625, 3.4375, 4.5 and 4.25."""
    assert 8 * packed(qtype, 32, 512).nbytes / (32 * 512) == bits


def test_bad_tensor_data_is_one_clear_error():
    data = gguf_weight(T.Q4_K, 3, 512)
    with pytest.raises(ModelError, match="multiple of 256"):
        kblocks.pack_q4_k(data, 320)
    with pytest.raises(ModelError, match="inconsistent"):
        kblocks.pack_q4_k(data[:, :-1].copy(), 512)
    with pytest.raises(ModelError, match="inconsistent"):
        kblocks.pack_q5_0(data.view(np.int8), 512)


def packed(qtype, rows: int, columns: int):
    pack, _ = PACKERS[qtype]
    return pack(gguf_weight(qtype, rows, columns, seed=rows + columns), columns)


# Float rounding only, the activations rounded to int8 as the kernel rounds them.
TOLERANCE = 1e-4


@pytest.mark.parametrize("qtype", list(PACKERS), ids=lambda t: t.name)
@pytest.mark.parametrize("rows, columns", [(1, 256), (17, 768), (100, 512)])
def test_the_matmul_is_the_dequantized_one(qtype, rows, columns):
    """The integer GEMV at every row count, on the weights as gguf-py reads them."""
    assert_matmul_is_the_dequantized_one(packed(qtype, rows, columns), rows, (1, 3, 32, 33, 100))


def assert_matmul_is_the_dequantized_one(strips, seed: int, token_counts) -> list[tuple[np.ndarray, np.ndarray]]:
    """matmul(x, strips) at each token count against x rounded to int8 times the weights as
    gguf-py reads them; the (x, result) pairs, for more checks."""
    weights = strips.dequantize()
    rng = np.random.default_rng(seed)
    results = []
    for tokens in token_counts:
        x = rng.standard_normal((tokens, weights.shape[1]), dtype=np.float32)
        want = int8_activations(x) @ weights.T
        got = matmul(x, strips)
        assert got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE * np.abs(want).max())
        results.append((x, got))
    return results


@pytest.mark.parametrize("qtype", list(PACKERS), ids=lambda t: t.name)
def test_the_int16_matmul_is_the_dequantized_one(qtype):
    """Activations rounded to int16 instead (the backend's choice for small models)."""
    strips = packed(qtype, 17, 768)
    weights = strips.dequantize()
    x = np.random.default_rng(2).standard_normal((33, 768), dtype=np.float32)
    got = matmul(x, strips, np.int16)
    want = int8_activations(x, 32767) @ weights.T
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE * np.abs(want).max())
    np.testing.assert_array_equal(matmul(x[5:6], strips, np.int16)[0], got[5])
    assert np.abs(got - x @ weights.T).max() < np.abs(matmul(x, strips) - x @ weights.T).max() / 20


@pytest.mark.parametrize("qtype", list(PACKERS), ids=lambda t: t.name)
def test_a_row_is_the_same_whatever_rows_share_its_gemv(qtype):
    strips = packed(qtype, 40, 512)
    x = np.random.default_rng(1).standard_normal((32, 512), dtype=np.float32)
    together = matmul(x, strips)
    for t in (0, 5, 31):
        np.testing.assert_array_equal(matmul(x[t:t + 1], strips)[0], together[t])


@pytest.mark.parametrize("qtype, per_block", [(T.Q4_K, Q4_1Strips), (T.Q5_K, Q5_1Strips)], ids=["Q4_K", "Q5_K"])
def test_compact_k_factors_multiply_as_per_block_ones(qtype, per_block):
    """Q4_K's and Q5_K's 8-bit sub-block factors under float16 d and -dmin give every kernel
    the same numbers, bit for bit, as the same weights with a scale and minimum per block, in
    fewer bytes (4.625 bits a weight to 5, 5.625 to 6). d and dmin are set to powers of two
    here, so that each block's products are float16 too, as per-block factors must be."""
    data = gguf_weight(qtype, 17, 768).reshape(17, 3, -1)
    data[:, :, 0:2] = np.array([2.0 ** -9], dtype=np.float16).view(np.uint8)  # d
    data[:, :, 2:4] = np.array([2.0 ** -7], dtype=np.float16).view(np.uint8)  # dmin
    strips = PACKERS[qtype][0](data.reshape(17, -1), 768)
    factors = strips.block_factors()
    assert np.array_equal(factors.astype(np.float16).astype(np.float32), factors)
    plain = per_block(np.ascontiguousarray(strips.q[..., :per_block.BLOCK_BYTES]), factors.astype(np.float16), 17)
    np.testing.assert_array_equal(plain.dequantize(), strips.dequantize())
    assert plain.nbytes > strips.nbytes
    x = np.random.default_rng(4).standard_normal((40, 768), dtype=np.float32)
    for rows in (x[:1], x[:32], x):
        np.testing.assert_array_equal(matmul(rows, strips), matmul(rows, plain))


def test_the_embedding_reads_rows_as_gguf_py_does():
    from model.ops.numba_ops import NumbaOps

    data = gguf_weight(T.Q6_K, 50, 256)
    ids = np.array([3, 3, 49, 0])
    got = NumbaOps("q8_0").embedding(kblocks.pack_q6_k(data, 256), ids)
    np.testing.assert_array_equal(got, gguf.quants.dequantize(data, T.Q6_K)[ids])
