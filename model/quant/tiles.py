"""AMX's int8 tiles in LLVM IR, for gemv.py's kernels where the CPU has them (cpu.AMX): a
(strip, block)'s 16 x 32 weights times 16 activation rows' 32 int8 values in one tdpbsud, the
256 exact int32 sums stored for the rows' float work, which stays the GEMV's own.

A strip's lines are already the layout a tile's right-hand operand takes (each 64-byte row: 4
consecutive weights for each of 16 rows, strips.py), so the weights go in as gemv.py unpacks
them; the activations' 16 rows are read in place, a row apart in xq. Signed activations times
unsigned weights (tdpbsud) is vpdpbusd's arithmetic, so the sums (and with them every bit of
the output) are what the vector path gives. Only for schemes with one scale a block (SCALES =
1): Q6_K's two would halve each product's depth, and measured slower than vpdpbusd.

Measured in one sitting on a 2-core Xeon with AMX, 1B Q4_K_M, prefill of 512 tokens
(tools/bench_model.py): 123-130 tok/s against 92-96 on vpdpbusd alone. The rows' float work
(scales, minima) is now most of a block's time.
"""

from llvmlite import ir
from numba.core import cgutils

from model.ops.llvm_ir import call
from model.quant.strips import BLOCK, LINE_BYTES, LINES, STRIP

ROWS = 16  # activation rows a tile holds
SUMS_BYTES = ROWS * STRIP * 4  # a tile of int32 sums
_TILES = 3  # a slot's: the sums, the activations, the weights
_I8, _I64 = ir.IntType(8), ir.IntType(64)


def _call(builder, name: str, *args: ir.Value) -> None:
    call(builder, name, ir.VoidType(), *args)


def _tile(index: int) -> ir.Constant:
    return ir.Constant(_I8, index)


def _configure(builder) -> None:
    """Load the tile shapes (palette 1): two slots of 3 tiles, each 16 rows of 16 int32 sums,
    16 rows of a block's 32 activation bytes, a block's 8 lines of weights."""
    config = bytearray(64)
    config[0] = 1
    shapes = ((ROWS, STRIP * 4), (ROWS, BLOCK), (LINES, LINE_BYTES))
    for slot in range(2):
        for i, (rows, row_bytes) in enumerate(shapes):
            tile = _TILES * slot + i
            config[16 + 2 * tile:18 + 2 * tile] = row_bytes.to_bytes(2, "little")
            config[48 + tile] = rows
    held = cgutils.alloca_once(builder, ir.ArrayType(_I8, 64))
    builder.store(ir.Constant(ir.ArrayType(_I8, 64), bytearray(config)), held)
    _call(builder, "llvm.x86.ldtilecfg", builder.bitcast(held, _I8.as_pointer()))


def products(builder, x: ir.Value, blocks: ir.Value, lines: ir.Value, sums: ir.Value) -> None:
    """Every block's products for 16 activation rows (x: row 0's first value, i8*; rows 32 x
    blocks bytes apart) times a strip's lines (lines: i8*, block b's 8 from byte 512 b)
    into sums (i8*): block b's at byte SUMS_BYTES b, its int32 row r, lane l at 64 r + 4 l: the
    dot of activation row r with weight row l over the block. Two slots of tiles take turns, so
    that one block's loads and multiply overlap the other's store."""
    _configure(builder)
    stride = builder.mul(blocks, ir.Constant(_I64, BLOCK))

    def product(slot, b):
        out, left, right = (_tile(_TILES * slot + i) for i in range(_TILES))
        _call(builder, "llvm.x86.tilezero", out)
        _call(builder, "llvm.x86.tileloadd64", left, builder.gep(x, [builder.mul(b, ir.Constant(_I64, BLOCK))]),
              stride)
        at = builder.gep(lines, [builder.mul(b, ir.Constant(_I64, LINES * LINE_BYTES))])
        _call(builder, "llvm.x86.tileloadd64", right, at, ir.Constant(_I64, LINE_BYTES))
        _call(builder, "llvm.x86.tdpbsud", out, left, right)
        _call(builder, "llvm.x86.tilestored64", out, builder.gep(sums, [builder.mul(b, ir.Constant(_I64, SUMS_BYTES))]),
              ir.Constant(_I64, STRIP * 4))

    with cgutils.for_range(builder, builder.udiv(blocks, ir.Constant(_I64, 2))) as loop:
        first = builder.mul(loop.index, ir.Constant(_I64, 2))
        product(0, first)
        product(1, builder.add(first, ir.Constant(_I64, 1)))
    with builder.if_then(builder.trunc(blocks, ir.IntType(1))):
        product(0, builder.sub(blocks, ir.Constant(_I64, 1)))
    _call(builder, "llvm.x86.tilerelease")


def row_sums(builder, sums: ir.Value, block: ir.Value, row: int) -> ir.Value:
    """Activation row `row`'s 16 int32 sums (one per weight row) of a block (products)."""
    at = builder.gep(sums, [builder.add(builder.mul(block, ir.Constant(_I64, SUMS_BYTES)),
                                        ir.Constant(_I64, row * STRIP * 4))])
    return builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(32), STRIP).as_pointer()), align=4)
