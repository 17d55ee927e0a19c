"""MXFP4 tensors (GPT-OSS's experts) packed as they are (model/quant/blocks.py, MXFP4Strips):
read back bit for bit as gguf-py dequantizes them, multiplied by the kernels as by NumPy, the
experts stacked through grouped_gemv, and each path's byte shuffle the table it stands for."""

import gguf
import llvmlite.binding as llvm
import numpy as np
import pytest
from llvmlite import ir
from reference import int8_activations
from test_kblocks import TOLERANCE, assert_matmul_is_the_dequantized_one

from model.quant import blocks, levels
from model.quant.gemv import gemv, grouped_gemv
from model.quant.matmul import matmul
from model.quant.quantized import QuantizedTensor
from model.quant.strips import MXFP4Strips

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def mxfp4_weight(rows: int, columns: int, seed: int = 0, exponents=(112, 132)) -> np.ndarray:
    """Random MXFP4 blocks as a file holds them: an exponent byte in [exponents) (GPT-OSS's lie
    around 2^-10 to 2^-1 times the doubled levels) and 16 bytes of random codes, so that every
    code, the negative zero among them, turns up."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, columns // 32, 17), dtype=np.uint8)
    data[..., 0] = rng.integers(*exponents, (rows, columns // 32))
    return data.reshape(rows, -1)


def packed(rows: int, columns: int, seed: int = 0) -> MXFP4Strips:
    return blocks.pack_mxfp4(mxfp4_weight(rows, columns, seed), columns)


@pytest.mark.parametrize("rows, columns, exponents", [(1, 32, (112, 132)), (17, 96, (112, 132)),
                                                      (100, 2880, (112, 132)), (40, 64, (0, 251))])
def test_packed_blocks_read_back_bit_for_bit(rows, columns, exponents):
    """Exponents across float32's range too: subnormal powers (0, 1) and above float16's."""
    data = mxfp4_weight(rows, columns, rows, exponents)
    data.setflags(write=False)  # as a memory-mapped file hands it over
    strips = blocks.pack_mxfp4(data, columns)
    assert type(strips) is MXFP4Strips and strips.shape == (rows, columns)
    want = gguf.quants.dequantize(data, MXFP4)
    np.testing.assert_array_equal(strips.dequantize().view(np.uint32), want.view(np.uint32))
    picked = np.array([rows - 1, 0, rows // 2])
    np.testing.assert_array_equal(strips.dequantize(picked).view(np.uint32), want[picked].view(np.uint32))


def test_the_file_s_bits_a_weight():
    """4.25: 4-bit codes and an exponent byte per 32 weights, the file's own."""
    assert 8 * packed(32, 512).nbytes / (32 * 512) == 4.25


def test_the_cpu_backend_keeps_mxfp4_packed():
    from model.ops.numba_ops import NumbaOps

    ops = NumbaOps("q8_0")
    w = ops.weight(QuantizedTensor("mxfp4", mxfp4_weight(48, 96), (48, 96)))
    assert isinstance(w, MXFP4Strips) and not ops.converted


@pytest.mark.parametrize("rows, columns", [(1, 32), (17, 96), (100, 2880)])
def test_the_matmul_is_the_dequantized_one(rows, columns):
    """The integer GEMV at every row count (1 to 100: the 4-2-1 rows, AMX's tiles where the CPU
    has them), on the weights as gguf-py reads them; rows past the last not a whole strip."""
    strips = packed(rows, columns, seed=rows)
    for x, got in assert_matmul_is_the_dequantized_one(strips, rows, (1, 3, 16, 33, 100)):
        np.testing.assert_array_equal(matmul(x[-1:], strips)[0], got[-1])


def test_the_int16_matmul_is_the_dequantized_one():
    strips = packed(17, 768)
    weights = strips.dequantize()
    x = np.random.default_rng(2).standard_normal((33, 768), dtype=np.float32)
    got = matmul(x, strips, np.int16)
    want = int8_activations(x, 32767) @ weights.T
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE * np.abs(want).max())
    np.testing.assert_array_equal(matmul(x[5:6], strips, np.int16)[0], got[5])


def test_stacked_experts_multiply_as_each_alone():
    """4 experts of 48 rows (3 strips each), stacked as a GGUF's ffn_*_exps are; 0, 20, 17 and
    23 rows routed to them: each expert's rows as the plain GEMV gives them (the same bits),
    and as its dequantized weights do."""
    experts, rows, columns = 4, 48, 320
    strips = packed(experts * rows, columns, seed=9)
    weights = strips.dequantize().reshape(experts, rows, columns)
    x = np.random.default_rng(4).standard_normal((60, columns), dtype=np.float32)
    starts, active = np.array([0, 0, 20, 37, 60]), np.array([1, 2, 3])
    got, plain = grouped_gemv(x, strips, experts, starts, active), gemv(x, (strips,))
    for e in active:
        mine = slice(starts[e], starts[e + 1])
        np.testing.assert_array_equal(got[mine], plain[mine, rows * e:rows * e + rows])
        want = int8_activations(x[mine]) @ weights[e].T
        np.testing.assert_allclose(got[mine], want, rtol=TOLERANCE, atol=TOLERANCE * np.abs(want).max())


@pytest.mark.parametrize("path, triple, cpu", [("avx512", "x86_64-unknown-linux-gnu", "x86-64-v4"),
                                               ("avx2", "x86_64-unknown-linux-gnu", "haswell"),
                                               ("neon", "aarch64-unknown-linux-gnu", "neoverse-n1"),
                                               ("portable", "x86_64-unknown-linux-gnu", "generic")])
def test_every_path_s_lookup_is_the_table(monkeypatch, path, triple, cpu):
    """levels() on each path's IR, every code in every byte, folded by LLVM's optimizer for
    that path's target (it folds vpshufb and tbl with constant operands): the table's bytes.
    ARM's tbl is checked here only, short of an ARM machine (tests/test_cpu_paths.py runs
    the GEMV under emulation where that is set up)."""
    monkeypatch.setattr(levels, "PATH", path)
    codes = [(7 * i + i // 16) % 16 for i in range(64)]
    bytes64 = ir.VectorType(ir.IntType(8), 64)
    got = folded(bytes64, lambda builder: levels.levels(builder, ir.Constant(bytes64, codes), MXFP4Strips.LEVELS),
                 triple, cpu)
    assert got == [MXFP4Strips.LEVELS[c] for c in codes]


def test_powers_of_two_are_gguf_py_s():
    """powers_of_two() for every exponent byte, folded by LLVM: gguf-py's float32 bits."""
    e = np.arange(256, dtype=np.uint8)
    ints = ir.VectorType(ir.IntType(32), 256)
    got = folded(ints, lambda builder: builder.bitcast(
        levels.powers_of_two(builder, ir.Constant(ir.VectorType(ir.IntType(8), 256), e.tolist())), ints))
    assert got == gguf.quants.MXFP4.e8m0_to_fp32_half(e).view(np.uint32).tolist()


def folded(result: ir.VectorType, body, triple: str = "", cpu: str = "") -> list[int]:
    """The constant integer lanes a function returning body(builder) folds to under LLVM's
    optimizer for the triple's CPU (this machine's where not given)."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    module = ir.Module()
    builder = ir.IRBuilder(ir.Function(module, ir.FunctionType(result, []), "f").append_basic_block())
    builder.ret(body(builder))
    target = llvm.Target.from_triple(triple) if triple else llvm.Target.from_default_triple()
    machine = target.create_target_machine(cpu=cpu, opt=2)
    module.triple = machine.triple
    optimized = llvm.parse_assembly(str(module))
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=2))
    passes.getModulePassManager().run(optimized, passes)
    returned = str(optimized.get_function("f")).partition(f"ret {result} <")[2].partition(">")[0]
    return [int(lane.split()[1]) % (1 << result.element.width) for lane in returned.split(",")]
