"""What MXFP4's stored bytes stand for, in LLVM IR, for gemv.py's kernels: a 4-bit code's level
(a 16-entry table, strips.MXFP4Strips.LEVELS) and an E8M0 exponent's power of two, exact.

The table is one byte shuffle a register where the CPU has one: vpshufb on AVX-512BW and AVX2
(the 16 levels in each 128-bit lane), tbl on 64-bit ARM. Other targets take a tree of 15
selects on the code's bits, plain IR that any back end lowers. Each gives the same bytes, so the
integer sums after them are the same on every path."""

from llvmlite import ir

from model.ops.llvm_ir import call, joined, pieces
from model.quant.cpu import PATH

# the shuffle of bytes by 4-bit indices, by the bits of its registers
_SHUFFLES = {"avx512": (512, "llvm.x86.avx512.pshuf.b.512"), "avx2": (256, "llvm.x86.avx2.pshuf.b"),
             "neon": (128, "llvm.aarch64.neon.tbl1.v16i8")}


def _each(vector: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(vector, [value] * vector.count)


def levels(builder, codes: ir.Value, table: tuple[int, ...]) -> ir.Value:
    """table[c] for the code c (0..15) in each byte of codes (n x i8)."""
    if PATH in _SHUFFLES:
        bits, name = _SHUFFLES[PATH]
        register = ir.VectorType(ir.IntType(8), bits // 8)
        lookup = ir.Constant(register, list(table) * (bits // 128))
        return joined(builder, [call(builder, name, register, lookup, piece) for piece in pieces(builder, codes, bits)])
    options = [_each(codes.type, level) for level in table]
    for bit in range(4):  # pairs of options that differ in this bit, lowest first
        set_ = builder.icmp_unsigned("!=", builder.and_(codes, _each(codes.type, 1 << bit)), _each(codes.type, 0))
        options = [builder.select(set_, high, low) for low, high in zip(options[::2], options[1::2])]
    return options[0]


def powers_of_two(builder, exponents: ir.Value) -> ir.Value:
    """2^(e - 128) as float32 for the E8M0 bytes e (n x i8), built from its bits as gguf-py
    builds it: exponent field e - 1, and for e of 0 and 1 the subnormals 2^-128 and 2^-127."""
    ints = ir.VectorType(ir.IntType(32), exponents.type.count)
    e = builder.zext(exponents, ints)
    normal = builder.shl(builder.sub(e, _each(ints, 1)), _each(ints, 23))
    subnormal = builder.shl(_each(ints, 0x200000), builder.and_(e, _each(ints, 1)))
    bits = builder.select(builder.icmp_unsigned("<", e, _each(ints, 2)), subnormal, normal)
    return builder.bitcast(bits, ir.VectorType(ir.FloatType(), exponents.type.count))
