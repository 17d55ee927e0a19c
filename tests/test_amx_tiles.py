"""AMX's int8 tiles in the GEMV (model/quant/tiles.py): on a CPU that has them, 16 rows at a time
go through one tile product a block, and every row still gets the bits it gets alone, on the
vector path (tests/test_cpu_paths.py compares the tiled rows with other CPUs' paths too)."""

import platform

import numpy as np
import pytest
from numba.core.codegen import get_host_cpu_features
from test_cpu_paths import kept_weights
from test_kblocks import PACKERS, packed

from model.quant import cpu, pack
from model.quant.gemv import gemv, grouped_gemv
from model.quant.matmul import matmul

HOST_HAS_AMX = {"+amx-tile", "+amx-int8"} <= set(get_host_cpu_features().split(","))


@pytest.mark.skipif(not (HOST_HAS_AMX and platform.system() == "Linux"), reason="no AMX on this CPU")
def test_the_tiles_are_used_where_the_cpu_has_them():
    assert cpu.AMX and cpu.VNNI == 512


@pytest.mark.parametrize("activations", [np.int8, np.int16])
def test_every_row_is_the_same_bits_in_a_tile_as_alone(activations):
    """16, 17, 47 and 100 rows: whole tiles, a tile and a row over, tiles and the 4-2-1 rows
    after them; int16 activations never tile, and give their own bits as before."""
    x = np.random.default_rng(3).standard_normal((100, 768), dtype=np.float32) * 4
    for kind, strips in kept_weights():
        rows = x[:, :strips.shape[1]]
        alone = np.concatenate([matmul(rows[t:t + 1], strips, activations) for t in range(len(rows))])
        for tokens in (16, 17, 47, 100):
            np.testing.assert_array_equal(matmul(rows[:tokens], strips, activations), alone[:tokens],
                                          err_msg=f"{kind}, {tokens} rows")


@pytest.mark.parametrize("qtype", [*PACKERS, "q8_0"], ids=lambda t: getattr(t, "name", t))
def test_an_experts_rows_are_the_same_bits_tiled_as_in_the_plain_gemv(qtype):
    """4 experts of 32 rows; 0, 20, 17 and 23 rows for them (tiles where an expert has 16 or
    more): each expert's rows as the plain GEMV gives them."""
    rng = np.random.default_rng(4)
    strips = pack.quantize(rng.standard_normal((128, 512), dtype=np.float32)) if qtype == "q8_0" else \
        packed(qtype, 128, 512)
    x = rng.standard_normal((60, 512), dtype=np.float32)
    starts, active = np.array([0, 0, 20, 37, 60]), np.array([1, 2, 3])
    got, plain = grouped_gemv(x, strips, 4, starts, active), gemv(x, (strips,))
    for e in active:
        np.testing.assert_array_equal(got[starts[e]:starts[e + 1]], plain[starts[e]:starts[e + 1], 32 * e:32 * e + 32])
