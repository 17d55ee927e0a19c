"""What the CPU kernels' hand-written LLVM (the numba intrinsics of model/quant/,
model/ops/numba_rowwise.py and model/ops/numba_attention.py) shares: where an array's data and
elements are, its shape, and one value in every lane of a vector."""

from llvmlite import ir


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
