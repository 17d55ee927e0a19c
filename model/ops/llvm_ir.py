"""What the CPU kernels' hand-written LLVM (the numba intrinsics of model/quant/,
model/ops/numba_rowwise.py and model/ops/numba_attention.py) shares: where an array's data and
elements are, its shape, one value in every lane of a vector, a vector split into registers and
joined again, and a call to an LLVM intrinsic."""

from llvmlite import ir
from numba.core import cgutils


def array(context, builder, arrty, value):
    """numba's array structure of an intrinsic's array argument (.data, .shape)."""
    return context.make_array(arrty)(context, builder, value)


def element(context, builder, arrty, value, offset) -> ir.Value:
    """The address of flat element offset of a C-contiguous array."""
    return builder.gep(array(context, builder, arrty, value).data, [offset])


def byte_address(context, builder, arrty, value, offset) -> ir.Value:
    """The same address as i8*, the type LLVM's memory intrinsics take."""
    return builder.bitcast(element(context, builder, arrty, value, offset), ir.IntType(8).as_pointer())


def splat(builder, value, vector: ir.VectorType) -> ir.Value:
    """value (of the vector's element type) in every lane."""
    i32 = ir.IntType(32)
    lane = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(lane, lane, ir.Constant(ir.VectorType(i32, vector.count), [0] * vector.count))


def call(builder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    """The intrinsic name (declared in the module on first use) called on args."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def pieces(builder, v: ir.Value, bits: int) -> list[ir.Value]:
    """v in pieces of `bits` bits (one register each), in lane order."""
    lanes = bits // v.type.element.width
    if lanes >= v.type.count:
        return [v]
    order = ir.VectorType(ir.IntType(32), lanes)
    return [builder.shuffle_vector(v, v, ir.Constant(order, list(range(at, at + lanes))))
            for at in range(0, v.type.count, lanes)]


def joined(builder, parts: list[ir.Value]) -> ir.Value:
    """The pieces of one vector (pieces) as that vector."""
    while len(parts) > 1:
        lanes = 2 * parts[0].type.count
        order = ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(lanes)))
        parts = [builder.shuffle_vector(a, b, order) for a, b in zip(parts[::2], parts[1::2])]
    return parts[0]
