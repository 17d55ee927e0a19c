"""What the CPU kernels' hand-written LLVM (the numba intrinsics of model/quant/,
model/ops/numba_rowwise.py and model/ops/numba_attention.py) shares: where an array's data and
elements are, its shape, one value in every lane of a vector, and a call to an LLVM intrinsic."""

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
