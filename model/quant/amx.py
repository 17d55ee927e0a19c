"""x @ w.T for many activation rows on AMX's tile unit (Sapphire Rapids and later), in bfloat16
pairs: the tile intrinsics, the bfloat16 split of weights and activations, and the GEMM.

Each strip's scaled weights split once per call into two bfloat16 parts (high and the rest, 16
significant bits together), the activations likewise, every product but low x low accumulated
in float32 tiles; strips go in pairs and rows 32 at a time, so four tile products are in flight
at once.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from model.ops.llvm_ir import array, byte_address
from model.quant.cpu import AMX
from model.quant.strips import STRIP, Q4_1Strips, Q8_0Strips, Strips, scheme


# --- AMX: the tile registers, named by number (immediates), configured per thread ------------

def _tile_call(builder, name: str, operands) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [o.type for o in operands]),
                                        f"llvm.x86.{name}")
    builder.call(fn, operands)


def _tile(number) -> ir.Constant:
    return ir.Constant(ir.IntType(8), number.literal_value)


@intrinsic
def _tile_config(typingctx, config):
    def codegen(context, builder, signature, args):
        _tile_call(builder, "ldtilecfg", [byte_address(context, builder, signature.args[0], args[0],
                                                   ir.Constant(ir.IntType(64), 0))])
        return context.get_dummy_value()
    return types.void(config), codegen


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, signature, args):
        _tile_call(builder, "tilerelease", [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic(prefer_literal=True)
def _tile_zero(typingctx, tile):
    if not isinstance(tile, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        _tile_call(builder, "tilezero", [_tile(tile)])
        return context.get_dummy_value()
    return types.void(tile), codegen


def _tile_memory(instruction: str):
    """An intrinsic (tile, array, element offset, row stride in bytes) for a tile load or store
    of 16 rows; the tile's number must be a literal."""
    def memory(typingctx, tile, array, offset, stride):
        if not isinstance(tile, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, args):
            _tile_call(builder, instruction, [_tile(tile), byte_address(context, builder, array, args[1], args[2]),
                                              context.cast(builder, args[3], stride, types.int64)])
            return context.get_dummy_value()
        return types.void(tile, array, offset, stride), codegen
    memory.__name__ = memory.__qualname__ = f"_tile_{instruction}"  # numba keys intrinsics by name
    return intrinsic(prefer_literal=True)(memory)


_tile_load, _tile_store = _tile_memory("tileloadd64"), _tile_memory("tilestored64")


@intrinsic(prefer_literal=True)
def _dot(typingctx, c, a, b):
    """Tile c += tile a (16 activation rows) times tile b (a block of 16 weight rows), in
    bfloat16 pairs accumulated in float32; the three numbers must be literals."""
    if not all(isinstance(t, types.IntegerLiteral) for t in (c, a, b)):
        return None

    def codegen(context, builder, signature, args):
        _tile_call(builder, "tdpbf16ps", [_tile(c), _tile(a), _tile(b)])
        return context.get_dummy_value()
    return types.void(c, a, b), codegen


# Every tile 16 rows of 64 bytes: C (0-3) 16 x 16 float32; A (4, 5) and B (6, 7) 16 x 32 bfloat16.
_TILES = np.zeros(64, dtype=np.uint8)
_TILES[0] = 1  # palette 1
_TILES[16:32:2] = 64  # bytes per row of tiles 0-7 (little-endian uint16)
_TILES[48:56] = 16  # their rows


@njit("void(float32[:, ::1], uint16[:, ::1], uint16[:, ::1])", parallel=True, cache=True, nogil=True)
def _split_bfloat16(x, high, rest):
    """x = high + rest, both bfloat16 (rounded to nearest even): 16 significant bits in all."""
    bits = x.view(np.uint32)
    for t in prange(x.shape[0]):
        part = np.empty(x.shape[1], dtype=np.float32)
        part_bits = part.view(np.uint32)
        for k in range(x.shape[1]):
            b = bits[t, k]
            h = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
            high[t, k] = np.uint16(h >> np.uint32(16))
            part_bits[k] = h
        for k in range(x.shape[1]):
            part[k] = x[t, k] - part[k]
        for k in range(x.shape[1]):
            b = part_bits[k]
            rest[t, k] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _round_to_bfloat16(builder, bits):
    """float32 bits -> the bfloat16 nearest (ties to even), still in the high half."""
    ints = bits.type
    c = lambda v: ir.Constant(ints, [v] * ints.count)
    odd = builder.and_(builder.lshr(bits, c(16)), c(1))
    return builder.and_(builder.add(builder.add(bits, c(0x7FFF)), odd), c(0xFFFF0000 - (1 << 32)))


@intrinsic(prefer_literal=True)
def _bfloat16_planes(typingctx, q, qs, s, planes, four_bit):
    """planes[b, 0] and planes[b, 1]: the high and low bfloat16 parts of strip s's block b,
    scaled, as tiles (16 x 32, in pairs); 16 significant bits together, so exact to 2^-17.
    four_bit (a literal): Q4_1 strips, each weight scale x q + minimum, rounded once as the
    float32 weights were."""
    if not isinstance(four_bit, types.BooleanLiteral):
        return None
    nibbles = four_bit.literal_value
    block_bytes, factors_per_block = scheme(nibbles).BLOCK_BYTES, scheme(nibbles).FACTORS

    def codegen(context, builder, signature, args):
        q_arr, qs_arr, planes_arr = (array(context, builder, signature.args[i], args[i]) for i in (0, 1, 3))
        s = args[2]
        i64, i32 = ir.IntType(64), ir.IntType(32)
        blocks = builder.extract_value(q_arr.shape, 1)
        ints16, floats16 = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        shorts16, bytes16 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(8), 16)
        with cgutils.for_range(builder, blocks) as loop:
            block = builder.add(builder.mul(s, blocks), loop.index)
            factors = builder.gep(qs_arr.data, [builder.mul(block, ir.Constant(i64, factors_per_block))])
            halves = []  # per factor (the scales; Q4_1's minima): a chunk of 16 weights is half a line,
            for offset in (0, 16) if nibbles else (0,):  # rows 0-7 (or 8-15), each twice
                f = builder.load(builder.bitcast(builder.gep(factors, [ir.Constant(i64, offset)]),
                                                 floats16.as_pointer()), align=4)
                halves.append([builder.shuffle_vector(f, f, ir.Constant(ints16, [8 * h + n // 2 for n in range(16)]))
                               for h in (0, 1)])
            src = builder.gep(q_arr.data, [builder.mul(block, ir.Constant(i64, block_bytes))])
            dst = builder.gep(planes_arr.data, [builder.mul(loop.index, ir.Constant(i64, 1024))])
            for chunk in range(32):
                line, half = chunk // 2, chunk % 2
                at = 32 * (line // 2) + 16 * half if nibbles else 16 * chunk  # Q4_1: two lines a byte
                raw = builder.load(builder.bitcast(builder.gep(src, [ir.Constant(i64, at)]), bytes16.as_pointer()),
                                   align=1)
                if nibbles:
                    raw = (builder.and_(raw, ir.Constant(bytes16, [15] * 16)) if line % 2 == 0
                           else builder.lshr(raw, ir.Constant(bytes16, [4] * 16)))
                    values = builder.uitofp(builder.zext(raw, ints16), floats16)
                else:
                    values = builder.sitofp(builder.sext(raw, ints16), floats16)
                w = builder.fmul(values, halves[0][half])
                if nibbles:
                    w = builder.fadd(w, halves[1][half])
                high = _round_to_bfloat16(builder, builder.bitcast(w, ints16))
                low = builder.fsub(w, builder.bitcast(high, floats16))
                low = _round_to_bfloat16(builder, builder.bitcast(low, ints16))
                for plane, part in ((0, high), (1, low)):
                    shorts = builder.trunc(builder.lshr(part, ir.Constant(ints16, [16] * 16)), shorts16)
                    out = builder.gep(dst, [ir.Constant(i64, 512 * plane + 16 * chunk)])
                    builder.store(shorts, builder.bitcast(out, shorts16.as_pointer()), align=2)
        return context.get_dummy_value()
    return types.void(q, qs, s, planes, four_bit), codegen


def _amx_gemm_kernel(weights: type[Strips]):
    """The GEMM compiled for one scheme (its nibbles a literal), under a name of its own: numba's
    cache keys on the name."""
    nibbles = weights.NIBBLES

    def gemm(tiles, high, rest, q, qs, out):
        """out[:, 16s:16s+32] for every pair of strips s, s + 1, 32 rows at a time: four C tiles
        (two row groups by two strips), so four products are in flight at once rather than a
        chain on one tile. For each block, the activations' high part (A, tiles 4 and 5) meets the
        weights' high part then their low part (B, tiles 6 and 7), then the activations' low part
        meets the weights' high part: every product but low x low, the one below float32's
        precision, accumulated over every block in the tile unit."""
        rows, in_dim = high.shape
        strips, blocks = q.shape[0], q.shape[1]
        a_stride, c_stride, width = in_dim * 2, out.shape[1] * 4, out.shape[1]
        for p in prange(-(-strips // 2)):
            s, t = 2 * p, min(2 * p + 1, strips - 1)  # an odd last strip is paired with itself
            _tile_config(tiles)
            planes, partner = np.empty((blocks, 2, 512), dtype=np.uint16), np.empty((blocks, 2, 512), dtype=np.uint16)
            _bfloat16_planes(q, qs, s, planes, nibbles)
            _bfloat16_planes(q, qs, t, partner, nibbles)
            for t0 in range(0, rows, 32):
                _tile_zero(0)
                _tile_zero(1)
                _tile_zero(2)
                _tile_zero(3)
                for b in range(blocks):
                    a = t0 * in_dim + b * 32
                    w = b * 1024
                    for x, w_part in ((high, 0), (high, 512), (rest, 0)):
                        _tile_load(4, x, a, a_stride)
                        _tile_load(5, x, a + 16 * in_dim, a_stride)
                        _tile_load(6, planes, w + w_part, 64)
                        _tile_load(7, partner, w + w_part, 64)
                        _dot(0, 4, 6)
                        _dot(1, 4, 7)
                        _dot(2, 5, 6)
                        _dot(3, 5, 7)
                c = t0 * width + s * 16
                _tile_store(0, out, c, c_stride)
                _tile_store(2, out, c + 16 * width, c_stride)
                if t != s:
                    _tile_store(1, out, c + 16, c_stride)
                    _tile_store(3, out, c + 16 * width + 16, c_stride)
            _tile_release()
    gemm.__name__ = gemm.__qualname__ = f"amx_gemm_{weights.kind}"
    return njit("void(uint8[::1], uint16[:, ::1], uint16[:, ::1], int8[:, :, ::1], float32[:, :, ::1], float32[:, ::1])",
                parallel=True, cache=True, nogil=True)(gemm)


# compiled only where the instructions exist
_AMX_GEMM = {weights: _amx_gemm_kernel(weights) for weights in (Q8_0Strips, Q4_1Strips)} if AMX else {}


def amx_gemm(x: np.ndarray, w: Strips) -> np.ndarray:
    """x @ w.T over every strip (rows past w's last included), for C-ordered float32 x."""
    tokens, in_dim = x.shape
    padded = -(-tokens // 32) * 32
    high = np.zeros((padded, in_dim), dtype=np.uint16)
    rest = np.zeros((padded, in_dim), dtype=np.uint16)
    _split_bfloat16(x, high[:tokens], rest[:tokens])
    out = np.empty((padded, w.q.shape[0] * STRIP), dtype=np.float32)
    _AMX_GEMM[type(w)](_TILES, high, rest, w.q, w.factors, out)
    return out[:tokens]


