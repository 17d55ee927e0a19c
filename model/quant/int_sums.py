"""A block's integer dot products in LLVM IR, for gemv.py's kernels: each row's sum over the lines
of a (strip, block) of its weights times a quad of activations, in int32 lanes, through the
instructions the CPU has (VNNI's vpdpbusd, AVX2's and AVX-512BW's pmaddubsw and pmaddwd, ARM's
sdot) or plain vector IR that LLVM lowers anywhere. Integer sums are exact every way, so all
give the same bits."""

from llvmlite import ir

from model.ops.llvm_ir import call, joined, pieces, splat
from model.quant.cpu import PATH, SDOT, VNNI
from model.quant.strips import LINE_BYTES, QUAD, STRIP, Strips

INTS16 = ir.VectorType(ir.IntType(32), STRIP)


def _adjacent_sums(builder, v: ir.Value) -> ir.Value:
    """v[2i] + v[2i + 1] for the 2n int32 lanes of v."""
    lanes = v.type.count
    halves = ir.VectorType(ir.IntType(32), lanes // 2)
    even, odd = (ir.Constant(halves, list(range(first, lanes, 2))) for first in (0, 1))
    return builder.add(builder.shuffle_vector(v, v, even), builder.shuffle_vector(v, v, odd))


def _pair_sums(builder, a: ir.Value, b: ir.Value) -> ir.Value:
    """a[2i] b[2i] + a[2i + 1] b[2i + 1] in int32 for 2n int16 lanes a and b: pmaddwd's
    arithmetic, exact for Spool's operands (bytes, so no sum overflows)."""
    ints = ir.VectorType(ir.IntType(32), a.type.count)
    return _adjacent_sums(builder, builder.mul(builder.sext(a, ints), builder.sext(b, ints)))


def _sdot_sums(builder, line_weights: list[ir.Value], quads: list[ir.Value], accs: list[ir.Value],
               signed: bool) -> list[ir.Value]:
    """ARM's sdot on each 16 bytes of each line (4 rows' quads) and the broadcast int8 quad of
    activations, into accs (4 x int32 each); the weights as signed bytes: the nibble schemes'
    (below 64) as they are, Q8_0's (signed) less 128, which is a flip of the top bit."""
    bytes_, ints = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.IntType(32), 4)
    for line, quad in zip(line_weights, quads):
        x = builder.bitcast(splat(builder, quad, ints), bytes_)
        if signed:
            line = builder.xor(line, ir.Constant(line.type, [-128] * line.type.count))
        for i, piece in enumerate(pieces(builder, line, 128)):
            accs[i] = call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", ints, accs[i], piece, x)
    return accs


# pmaddubsw and pmaddwd by register width
_MADD = {512: ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
         256: ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd")}


def group_sum(builder, line_weights: list[ir.Value], quads: list[ir.Value], x_sum: ir.Value | None,
               weights: type[Strips]) -> ir.Value:
    """In each row's lane (16 x int32), the sum over lines of its 4 weights less ZERO (unsigned
    bytes, nibble schemes' below 64) times the line's quad of activations (int8 as one int32, or
    int16 as one int64); x_sum is the quads' activation sum (None without ZERO), ZERO's part
    taken off at once. For int8: vpdpbusd where the target has VNNI, a register at a time; else
    on AVX2 or AVX-512BW, pmaddubsw (pair sums in int16) then pmaddwd by ones: the nibble schemes'
    unsigned weights as they are (2 x 63 x 127 cannot saturate), Q8_0's (and IQ4's levels) as the
    signed bytes they stand for, their magnitudes times the activations with the weights' signs (llama.cpp's
    trick: 2 x 128 x 127 cannot either); on ARM with the dot product, sdot (_sdot_sums).
    Otherwise, and for int16, the same integers through int16 pair sums in plain IR."""
    quad_bits = quads[0].type.width
    madd = PATH in ("avx2", "avx512")  # pmaddubsw
    signed = weights.SIGNED_VALUES and (SDOT or (madd and not VNNI))  # Q8_0's bytes as their int8 values
    start = ir.Constant(INTS16, None)
    if x_sum is not None and not (quad_bits == 32 and signed):
        start = splat(builder, builder.mul(x_sum, ir.Constant(ir.IntType(32), -weights.ZERO)), INTS16)
    if quad_bits == 32 and SDOT:
        return joined(builder, _sdot_sums(builder, line_weights, quads, pieces(builder, start, 128), signed))
    if quad_bits == 32 and (VNNI or (madd and (weights.NIBBLES or signed))):
        bits = VNNI or (512 if PATH == "avx512" and not signed else 256)
        ints, bytes_ = ir.VectorType(ir.IntType(32), bits // 32), ir.VectorType(ir.IntType(8), bits // 8)
        shorts = ir.VectorType(ir.IntType(16), bits // 16)
        accs = pieces(builder, start, bits)
        for line, quad in zip(line_weights, quads):
            x = builder.bitcast(splat(builder, quad, ints), bytes_)
            for i, piece in enumerate(pieces(builder, line, bits)):
                if VNNI:
                    accs[i] = call(builder, f"llvm.x86.avx512.vpdpbusd.{bits}", ints, accs[i],
                                    builder.bitcast(piece, ints), builder.bitcast(x, ints))
                    continue
                factor = x
                if signed:  # the stored byte less 128 is the value; |value| times x with its sign
                    value = builder.xor(piece, ir.Constant(bytes_, [-128] * bytes_.count))
                    piece = call(builder, f"llvm.abs.v{bytes_.count}i8", bytes_, value, ir.Constant(ir.IntType(1), 0))
                    factor = call(builder, "llvm.x86.avx2.psign.b", bytes_, x, value)
                pair_sums, quad_sums = _MADD[bits]
                pairs = call(builder, pair_sums, shorts, piece, factor)
                ones = ir.Constant(shorts, [1] * shorts.count)
                accs[i] = builder.add(accs[i], call(builder, quad_sums, ints, pairs, ones))
        return joined(builder, accs)
    shorts = ir.VectorType(ir.IntType(16), LINE_BYTES)
    pairs = None  # 32 int32 lanes: row r's weights 4l, 4l + 1 in lane 2r, 4l + 2, 4l + 3 in 2r + 1
    for line, quad in zip(line_weights, quads):
        four = builder.bitcast(quad, ir.VectorType(ir.IntType(quad_bits // QUAD), QUAD))
        if quad_bits == 32:
            four = builder.sext(four, ir.VectorType(ir.IntType(16), QUAD))
        x = builder.shuffle_vector(four, four, ir.Constant(ir.VectorType(ir.IntType(32), LINE_BYTES),
                                                           [j % QUAD for j in range(LINE_BYTES)]))
        part = _pair_sums(builder, builder.zext(line, shorts), x)
        pairs = part if pairs is None else builder.add(pairs, part)
    return builder.add(start, _adjacent_sums(builder, pairs))
