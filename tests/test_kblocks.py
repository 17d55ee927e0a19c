"""GGUF's K-quant and 5-bit tensors packed as they are (model/quant/kblocks.py): read back bit
for bit as gguf-py dequantizes them, and multiplied by the kernels as by NumPy."""

import gguf
import numpy as np
import pytest

from model.errors import ModelError
from model.quant import kblocks
from model.quant.kquants import quantize
from model.quant.strips import Q4_1Strips, Q5_0Strips, Q5_1Strips, Q6_KStrips

T = gguf.GGMLQuantizationType
PACKERS = {T.Q4_K: (kblocks.pack_q4_k, Q4_1Strips), T.Q5_0: (kblocks.pack_q5_0, Q5_0Strips),
           T.Q5_1: (kblocks.pack_q5_1, Q5_1Strips), T.Q5_K: (kblocks.pack_q5_k, Q5_1Strips),
           T.Q6_K: (kblocks.pack_q6_k, Q6_KStrips)}


def gguf_weight(qtype, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights as qtype's bytes (Spool's K-quantizers, gguf-py's for Q5_0 and Q5_1),
    rows of very different magnitudes and a zero row among them."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, columns), dtype=np.float32) * rng.choice([1e-3, 0.05, 3], rows)[:, None]
    w[rows // 2] = 0
    return quantize(w.astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", list(PACKERS), ids=lambda t: t.name)
@pytest.mark.parametrize("rows, columns", [(1, 256), (17, 768), (100, 512)])
def test_packed_blocks_read_back_bit_for_bit(qtype, rows, columns):
    data = gguf_weight(qtype, rows, columns)
    pack, scheme = PACKERS[qtype]
    strips = pack(data, columns)
    assert type(strips) is scheme and strips.shape == (rows, columns)
    want = gguf.quants.dequantize(data, qtype)
    np.testing.assert_array_equal(strips.dequantize().view(np.uint32), want.view(np.uint32))
    picked = np.array([rows - 1, 0, rows // 2])
    np.testing.assert_array_equal(strips.dequantize(picked).view(np.uint32), want[picked].view(np.uint32))


def test_bad_tensor_data_is_one_clear_error():
    data = gguf_weight(T.Q4_K, 3, 512)
    with pytest.raises(ModelError, match="multiple of 256"):
        kblocks.pack_q4_k(data, 320)
    with pytest.raises(ModelError, match="inconsistent"):
        kblocks.pack_q4_k(data[:, :-1].copy(), 512)
    with pytest.raises(ModelError, match="inconsistent"):
        kblocks.pack_q5_0(data.view(np.int8), 512)
