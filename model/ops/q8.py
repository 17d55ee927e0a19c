"""8-bit weights for the CPU backend: llama.cpp's Q8_0 numbers, 32 int8 values and one float32
scale per block along each weight row (9 bits a weight; float32 is 32), stored in strips. A
weight that is exactly Q4_1 (each block a minimum plus a scale times 0..15, as a GGUF's Q4_1
tensors come: the default model's projections do) is kept so instead, two values a byte (6 bits
a weight with its float32 scale and minimum): nothing rounded again, and fewer bytes to read.

A strip is 16 weight rows; each (strip, block) holds its 16 x 32 int8 values as 16 lines of
32 bytes, line r holding weights 2r and 2r+1 of the block for each of the 16 rows in turn.
That is the order a vector unit wants: one line times a broadcast pair of activations gives the
16 rows' partial sums in 16 lanes (vpmaddwd), with no reduction across lanes, and it is the
layout of an AMX bfloat16 tile of the weights. Rows past the last are zero.

Three ways to multiply, by the number of activation rows and what the CPU has:
- up to GEMV_ROWS rows, a GEMV: the activations scaled to int16 per block, each line through
  vpmaddwd, the int32 sums scaled into 16 float lanes per block (_strip_dot, AVX-512BW);
  elsewhere the same walk in float32 (_gemv). A decode step at batch 1 reads every weight once,
  so it is bound by memory bandwidth: a quarter of the bytes makes it faster;
- above, with AMX (Sapphire Rapids and later), a GEMM on the tile unit (_amx_gemm): each strip's
  scaled weights split once per call into two bfloat16 parts (high and the rest, 16
  significant bits together), the activations likewise, every product but low x low
  accumulated in float32 tiles; strips go in pairs and rows 32 at a time, so four tile
  products are in flight at once;
- above, without AMX, strips widened to float32 a slab at a time for OpenBLAS (_widen).
"""

import ctypes
import platform
from dataclasses import dataclass

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from model.ops.llvm_ir import array, byte_address, splat

BLOCK = 32
STRIP = 16  # weight rows a strip holds: an AMX tile's width in float32 outputs
GEMV_ROWS = 32  # up to this many activation rows, the GEMV; above, the GEMM
SLAB_ROWS = 512  # without AMX, weight rows widened at a time: 512 x 1536 float32 is 3 MB

_FEATURES = set(llvm.get_host_cpu_features().flatten().split(","))
# int16 activations lose nothing measurable; int8 ones, as llama.cpp's Q8_0 dot uses, cut the
# top-1 agreement with float32 on the default model from 98.25% to 96.35%.
PMADDWD = "+avx512bw" in _FEATURES


def _amx_permitted() -> bool:
    """Linux hands out the AMX tile state only to a process that asks (arch_prctl)."""
    if not {"+amx-tile", "+amx-bf16"} <= _FEATURES or platform.system() != "Linux" \
            or platform.machine() != "x86_64":
        return False
    sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return ctypes.CDLL(None).syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0


AMX = _amx_permitted()


@dataclass
class Q8Weight:
    """Q8_0 blocks in strips; or, when `q` holds half as many bytes, Q4_1 blocks (a weight is
    scale x q + minimum, q in 0..15), each byte two lines' values: line 2p in its low nibble,
    line 2p + 1 in its high one."""

    q: np.ndarray  # (strips, blocks, STRIP * BLOCK) int8 in strip order; Q4_1: (strips, blocks, 256) packed
    scale: np.ndarray  # (strips, blocks, STRIP) float32; Q4_1: (strips, blocks, 2 * STRIP), scales then minima
    rows: int  # the weight's rows; the strips may hold up to 15 more, zero

    @property
    def four_bit(self) -> bool:
        return self.q.shape[2] == STRIP * BLOCK // 2

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.q.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def quantizable(w: np.ndarray) -> bool:
    return w.ndim == 2 and w.shape[1] % BLOCK == 0


def quantize(w: np.ndarray) -> Q8Weight:
    """Round to nearest, each block scaled so that its largest magnitude is 127."""
    q, scale = _strips(w, STRIP * BLOCK, STRIP)
    _quantize_strips(np.ascontiguousarray(w, dtype=np.float32), q, scale)
    return Q8Weight(q, scale, w.shape[0])


def exact_q4_1(w: np.ndarray) -> Q8Weight | None:
    """w as Q4_1 blocks if it is exactly that: every block of 32 is minimum + scale x q, q in
    0..15, as llama.cpp's Q4_1 (whose blocks span q = 0 to 15) dequantizes to float32. The
    default model's projections come so from its GGUF: kept in 4 bits they lose nothing, where
    Q8_0 would round them again, and a step reads 40% fewer bytes. None for anything else."""
    q, factors = _strips(w, STRIP * BLOCK // 2, 2 * STRIP)
    exact = np.zeros(q.shape[0], dtype=np.bool_)
    _pack_q4_1_strips(np.ascontiguousarray(w, dtype=np.float32), q.view(np.uint8), factors, exact)
    return Q8Weight(q, factors, w.shape[0]) if exact.all() else None


def _strips(w: np.ndarray, line_bytes: int, factors: int) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed (q, factors) in strip order for w, so that the rows past its last stay zero."""
    strips, blocks = -(-w.shape[0] // STRIP), w.shape[1] // BLOCK
    return (np.zeros((strips, blocks, line_bytes), dtype=np.int8),
            np.zeros((strips, blocks, factors), dtype=np.float32))


# Start-up runs these on every weight (135M numbers for the default model), once each: one pass
# on all cores, where NumPy took 2.3 s over its temporaries. No fastmath: the rounding must be
# NumPy's (float32 throughout, ties to even), and the Q4_1 test exact.
@njit("void(float32[:, ::1], int8[:, :, ::1], float32[:, :, ::1])", parallel=True, cache=True, nogil=True)
def _quantize_strips(w, q, scale):
    """Q8_0: row r, weight k of a block goes to line k // 2, byte 2r + k % 2 (the strip order)."""
    rows, blocks = w.shape[0], q.shape[1]
    for s in prange(q.shape[0]):
        for r in range(min(STRIP, rows - s * STRIP)):
            row = s * STRIP + r
            for b in range(blocks):
                values = w[row, b * BLOCK:(b + 1) * BLOCK]
                step = np.abs(values).max() / np.float32(127)
                scale[s, b, r] = step
                if step == 0:
                    step = np.float32(1)
                for k in range(BLOCK):
                    q[s, b, (k // 2) * 2 * STRIP + 2 * r + k % 2] = np.int8(np.rint(values[k] / step))


@njit(cache=True, nogil=True)
def _pack_q4_1_strip(w, q, factors, s):
    """Strip s as Q4_1 if each block of its rows is exactly minimum + scale x (0..15); False at
    the first value that is not. Lines as Q8_0's, two to a byte (line 2p in the low nibble,
    2p + 1 in the high one); factors are the 16 rows' scales, then their minima."""
    for r in range(min(STRIP, w.shape[0] - s * STRIP)):
        row = s * STRIP + r
        for b in range(q.shape[1]):
            values = w[row, b * BLOCK:(b + 1) * BLOCK]
            low, high = values.min(), values.max()
            step = (high - low) / np.float32(15)
            factors[s, b, r], factors[s, b, STRIP + r] = step, low
            divisor = step if step > 0 else np.float32(1)
            for k in range(BLOCK):
                level = np.rint((values[k] - low) / divisor)
                if not (level <= 15 and level * step + low == values[k]):
                    return False
                q[s, b, (k // 4) * 2 * STRIP + 2 * r + k % 2] |= np.uint8(level) << np.uint8(4 * (k // 2 % 2))
    return True


@njit("void(float32[:, ::1], uint8[:, :, ::1], float32[:, :, ::1], boolean[::1])", parallel=True, cache=True,
      nogil=True)
def _pack_q4_1_strips(w, q, factors, exact):
    """exact[s]: whether strip s's rows are Q4_1, packed where they are (_pack_q4_1_strip)."""
    for s in prange(q.shape[0]):
        exact[s] = _pack_q4_1_strip(w, q, factors, s)


def compress(w: np.ndarray) -> Q8Weight:
    """Q4_1 where w is exactly that and the CPU has the kernels for it (AVX-512 and AMX);
    else Q8_0."""
    return (PMADDWD and AMX and exact_q4_1(w)) or quantize(w)


def dequantize(w: Q8Weight, rows=slice(None)) -> np.ndarray:
    """The float32 rows (all, or those an index picks: the embedding's lookup)."""
    index = np.arange(w.rows)[rows]
    strips, blocks = w.q.shape[:2]
    q = w.q
    if w.four_bit:
        packed = q.view(np.uint8).reshape(strips, blocks, BLOCK // 4, 1, STRIP * 2)
        q = np.concatenate([packed & 15, packed >> 4], axis=3)
    lines = q.reshape(strips, blocks, BLOCK // 2, STRIP, 2)
    values = lines[index // STRIP, :, :, index % STRIP, :]  # (rows, blocks, pair, 2)
    scale = w.scale[index // STRIP, :, index % STRIP]  # (rows, blocks)
    out = values.reshape(len(index), blocks, BLOCK) * scale[..., None]
    if w.four_bit:
        out = out + w.scale[index // STRIP, :, STRIP + index % STRIP][..., None]
    return out.reshape(len(index), blocks * BLOCK).astype(np.float32)


@njit("void(float32[:, ::1], int8[:, :, ::1], float32[:, :, ::1], float32[:, ::1])",
      parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv(x, q, scale, out):
    """out = x @ weight.T in float32, a strip at a time: for machines without AVX-512."""
    tokens = x.shape[0]
    strips, blocks = q.shape[0], q.shape[1]
    for s in prange(strips):
        for t in range(tokens):
            acc = np.zeros(16, dtype=np.float32)
            part = np.empty(16, dtype=np.float32)
            for b in range(blocks):
                part[:] = 0
                for r in range(16):
                    x0, x1 = x[t, b * 32 + 2 * r], x[t, b * 32 + 2 * r + 1]
                    for n in range(16):
                        part[n] += q[s, b, r * 32 + 2 * n] * x0 + q[s, b, r * 32 + 2 * n + 1] * x1
                for n in range(16):
                    acc[n] += part[n] * scale[s, b, n]
            for n in range(16):
                out[t, s * 16 + n] = acc[n]


@njit("void(int8[:, :, ::1], float32[:, :, ::1], int64, float32[:, ::1])",
      parallel=True, fastmath=True, cache=True, nogil=True)
def _widen(q, scale, first, out):
    """out[16i + n] = row n of strip first + i, in float32 (the strips that fit out)."""
    blocks = q.shape[1]
    for i in prange(out.shape[0] // 16):
        s = first + i
        for b in range(blocks):
            for r in range(16):
                for n in range(16):
                    out[i * 16 + n, b * 32 + 2 * r] = q[s, b, r * 32 + 2 * n] * scale[s, b, n]
                    out[i * 16 + n, b * 32 + 2 * r + 1] = q[s, b, r * 32 + 2 * n + 1] * scale[s, b, n]


@intrinsic(prefer_literal=True)
def _strip_dot(typingctx, q, s, xq, t, qs, xs, xsum, out, four_bit):
    """out[t, 16s:16s+16] = strip s times activation row t: per block, 16 lines of 32 weights
    (widened to int16) times a broadcast pair of int16 activations through vpmaddwd, summed in
    int32, then scaled by the weight and activation scales into 16 float lanes. four_bit (a
    literal): Q4_1 strips, each 32-byte line pair split into its two lines of nibbles, and
    each row's minimum times the block's activation sum (xsum) added."""
    if not isinstance(four_bit, types.BooleanLiteral):
        return None
    nibbles = four_bit.literal_value

    def codegen(context, builder, signature, args):
        q_arr, xq_arr, qs_arr, xs_arr, xsum_arr, out_arr = (
            array(context, builder, signature.args[i], args[i]) for i in (0, 2, 4, 5, 6, 7))
        s, t = args[1], args[3]
        i64, i32, i16 = ir.IntType(64), ir.IntType(32), ir.IntType(16)
        blocks = builder.extract_value(q_arr.shape, 1)
        width = builder.extract_value(out_arr.shape, 1)
        block_bytes, factors_per_block = (256, 32) if nibbles else (512, 16)
        bytes32, shorts32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(i16, 32)
        ints16, floats16 = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ints16, [shorts32, shorts32]),
                                                 "llvm.x86.avx512.pmaddw.d.512")
        q_strip = builder.gep(q_arr.data, [builder.mul(s, builder.mul(blocks, ir.Constant(i64, block_bytes)))])
        x_row = builder.gep(xq_arr.data, [builder.mul(t, builder.mul(blocks, ir.Constant(i64, 32)))])
        qs_strip = builder.gep(qs_arr.data, [builder.mul(s, builder.mul(blocks, ir.Constant(i64, factors_per_block)))])
        xs_row = builder.gep(xs_arr.data, [builder.mul(t, blocks)])
        xsum_row = builder.gep(xsum_arr.data, [builder.mul(t, blocks)])
        acc = cgutils.alloca_once_value(builder, ir.Constant(floats16, None))

        def load_bytes(at):
            return builder.load(builder.bitcast(at, bytes32.as_pointer()), align=1)

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            lines = builder.gep(q_strip, [builder.mul(b, ir.Constant(i64, block_bytes))])
            pairs = builder.bitcast(builder.gep(x_row, [builder.mul(b, ir.Constant(i64, 32))]), i32.as_pointer())
            if nibbles:  # line r: the low (r even) or high nibbles of byte pair r // 2
                both = [load_bytes(builder.gep(lines, [ir.Constant(i64, 32 * p)])) for p in range(8)]
                weights = [builder.zext(builder.and_(both[r // 2], ir.Constant(bytes32, [15] * 32)) if r % 2 == 0
                                        else builder.lshr(both[r // 2], ir.Constant(bytes32, [4] * 32)), shorts32)
                           for r in range(16)]
            else:
                weights = [builder.sext(load_bytes(builder.gep(lines, [ir.Constant(i64, 32 * r)])), shorts32)
                           for r in range(16)]
            ints = ir.Constant(ints16, None)
            for r in range(16):
                pair = splat(builder, builder.load(builder.gep(pairs, [ir.Constant(i64, r)]), align=2), ints16)
                ints = builder.add(ints, builder.call(pmaddwd, [weights[r], builder.bitcast(pair, shorts32)]))
            factors = builder.gep(qs_strip, [builder.mul(b, ir.Constant(i64, factors_per_block))])
            scales = builder.load(builder.bitcast(factors, floats16.as_pointer()), align=4)
            x_scale = splat(builder, builder.load(builder.gep(xs_row, [b])), floats16)
            block = builder.fmul(builder.sitofp(ints, floats16), builder.fmul(scales, x_scale))
            if nibbles:
                minima = builder.gep(factors, [ir.Constant(i64, 16)])
                minima = builder.load(builder.bitcast(minima, floats16.as_pointer()), align=4)
                x_sum = splat(builder, builder.load(builder.gep(xsum_row, [b])), floats16)
                block = builder.fadd(block, builder.fmul(minima, x_sum))
            builder.store(builder.fadd(builder.load(acc), block), acc)
        dest = builder.gep(out_arr.data, [builder.add(builder.mul(t, width), builder.mul(s, ir.Constant(i64, 16)))])
        builder.store(builder.load(acc), builder.bitcast(dest, floats16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(q, s, xq, t, qs, xs, xsum, out, four_bit), codegen


@njit("void(float32[:, ::1], int16[:, ::1], float32[:, ::1], float32[:, ::1])", fastmath=True, cache=True,
      nogil=True)
def _scale_to_int16(x, xq, xs, xsum):
    """Activations to int16 blocks of 32 with one scale each, rounded to nearest; and each
    block's sum as rounded (for Q4_1's minima)."""
    tokens, in_dim = x.shape
    for t in range(tokens):
        for b in range(in_dim // 32):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[t, b * 32 + j]))
            s = top / np.float32(32767.0)
            xs[t, b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            total = 0
            for j in range(32):
                v = np.int16(np.rint(x[t, b * 32 + j] * inv))
                xq[t, b * 32 + j] = v
                total += v
            xsum[t, b] = total * s


def _pmaddwd_gemv_kernel():
    @njit("void(int16[:, ::1], float32[:, ::1], float32[:, ::1], int8[:, :, ::1], float32[:, :, ::1], float32[:, ::1])",
          parallel=True, fastmath=True, cache=True, nogil=True)
    def gemv(xq, xs, xsum, q, qs, out):
        four_bit = q.shape[2] == 256
        for s in prange(q.shape[0]):
            for t in range(xq.shape[0]):
                if four_bit:
                    _strip_dot(q, s, xq, t, qs, xs, xsum, out, True)
                else:
                    _strip_dot(q, s, xq, t, qs, xs, xsum, out, False)
    return gemv


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

    def codegen(context, builder, signature, args):
        q_arr, qs_arr, planes_arr = (array(context, builder, signature.args[i], args[i]) for i in (0, 1, 3))
        s = args[2]
        i64, i32 = ir.IntType(64), ir.IntType(32)
        blocks = builder.extract_value(q_arr.shape, 1)
        ints16, floats16 = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        shorts16, bytes16 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(8), 16)
        with cgutils.for_range(builder, blocks) as loop:
            block = builder.add(builder.mul(s, blocks), loop.index)
            factors = builder.gep(qs_arr.data, [builder.mul(block, ir.Constant(i64, 32 if nibbles else 16))])
            halves = []  # per factor (the scales; Q4_1's minima): a chunk of 16 weights is half a line,
            for offset in (0, 16) if nibbles else (0,):  # rows 0-7 (or 8-15), each twice
                f = builder.load(builder.bitcast(builder.gep(factors, [ir.Constant(i64, offset)]),
                                                 floats16.as_pointer()), align=4)
                halves.append([builder.shuffle_vector(f, f, ir.Constant(ints16, [8 * h + n // 2 for n in range(16)]))
                               for h in (0, 1)])
            src = builder.gep(q_arr.data, [builder.mul(block, ir.Constant(i64, 256 if nibbles else 512))])
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


def _amx_gemm_kernel():
    @njit("void(uint8[::1], uint16[:, ::1], uint16[:, ::1], int8[:, :, ::1], float32[:, :, ::1], float32[:, ::1])",
          parallel=True, cache=True, nogil=True)
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
            if q.shape[2] == 256:  # Q4_1
                _bfloat16_planes(q, qs, s, planes, True)
                _bfloat16_planes(q, qs, t, partner, True)
            else:
                _bfloat16_planes(q, qs, s, planes, False)
                _bfloat16_planes(q, qs, t, partner, False)
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
    return gemm


# compiled only where the instructions exist
_pmaddwd_gemv = _pmaddwd_gemv_kernel() if PMADDWD else None
_amx_gemm = _amx_gemm_kernel() if AMX else None
_slab = np.empty(0, dtype=np.float32)


def matmul(x: np.ndarray, w: Q8Weight) -> np.ndarray:
    """x @ w.T for activations x (tokens, in), as float32 (tokens, out)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    tokens, in_dim = x.shape
    strips = w.q.shape[0]
    if tokens <= GEMV_ROWS:
        out = np.empty((tokens, strips * STRIP), dtype=np.float32)
        if PMADDWD:
            xq = np.empty(x.shape, dtype=np.int16)
            xs = np.empty((tokens, in_dim // BLOCK), dtype=np.float32)
            xsum = np.empty((tokens, in_dim // BLOCK), dtype=np.float32)
            _scale_to_int16(x, xq, xs, xsum)
            _pmaddwd_gemv(xq, xs, xsum, w.q, w.scale, out)
        else:
            _gemv(x, w.q, w.scale, out)
    elif AMX:
        padded = -(-tokens // 32) * 32
        high = np.zeros((padded, in_dim), dtype=np.uint16)
        rest = np.zeros((padded, in_dim), dtype=np.uint16)
        _split_bfloat16(x, high[:tokens], rest[:tokens])
        out = np.empty((padded, strips * STRIP), dtype=np.float32)
        _amx_gemm(_TILES, high, rest, w.q, w.scale, out)
        out = out[:tokens]
    else:
        out = _blas_matmul(x, w)
    return out if w.rows == out.shape[1] else np.ascontiguousarray(out[:, :w.rows])


def _blas_matmul(x: np.ndarray, w: Q8Weight) -> np.ndarray:
    global _slab
    strips, in_dim = w.q.shape[0], w.shape[1]
    out = np.empty((x.shape[0], strips * STRIP), dtype=np.float32)
    if _slab.size < SLAB_ROWS * in_dim:
        _slab = np.empty(SLAB_ROWS * in_dim, dtype=np.float32)
    for first in range(0, strips, SLAB_ROWS // STRIP):
        count = min(SLAB_ROWS // STRIP, strips - first)
        slab = _slab[:count * STRIP * in_dim].reshape(count * STRIP, in_dim)
        _widen(w.q, w.scale, first, slab)
        start = first * STRIP
        np.matmul(x, slab.T, out=out[:, start:start + count * STRIP])
    return out
