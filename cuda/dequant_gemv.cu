// GGUF's quantized weights kept packed on the device, each row its file's blocks as they are
// (model/ops/cuda_quant.py): Q8_0, Q4_0 and Q4_1 (blocks of 32 values), Q4_K, Q5_K and Q6_K
// (super-blocks of 256); AWQ and GPTQ checkpoints' int4 weights, repacked at load into blocks
// of 32 or 128 (INT4_32, INT4_128); and FP8 checkpoints' e4m3 weights, likewise (FP8_32,
// FP8_128). Each block's scales are decoded here, value = scale * code + offset.
//
// dequant_gemv: out[r, first + n] = sum_k x[r, k] * w[n, k] (+ bias[n]) for a few activation
// rows (decode steps), in fp32, rounded once to OUT (the storage type, or fp32 for logits). A
// warp a weight row, a block 4 of them times 8 activation rows (grid.x over the weight's rows, so
// a 262k vocabulary fits; grid.y over the activations' eights). A warp takes a row 256 values a
// step: a K-quant's super-block, or 8 blocks of 32; each lane its fixed share of them (runs of 2
// to 8 values, read with one aligned load per activation row), so a row's sum runs in one order
// set by k alone (each lane's steps in order, then the warp's xor tree): the same bits whatever
// the other rows of the batch.
//
// dequant_rows: whole rows in the storage type: an embedding's gather (ids; an id outside the
// table gives zeros, as embedding.cu) or a tile of the weight for a GEMM (first + i), a block a
// row, a warp a step.
//
// Blocks are 34 (Q8_0), 18 (Q4_0) and 210 (Q6_K) bytes, so their fields are only 2-byte
// aligned: loads are 2 or 4 bytes, as aligned as the format allows.
#include "common.cuh"

constexpr int STEP = 256;  // values of a row a warp takes at a time
constexpr int BLOCK_ROWS = 8;  // activation rows a dequant_gemv block takes
constexpr int BLOCK_WARPS = 4;  // weight rows a dequant_gemv block takes, a warp each

__device__ __forceinline__ unsigned load_u16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}
__device__ __forceinline__ unsigned load_u32(const unsigned char* p) { return *reinterpret_cast<const unsigned*>(p); }
__device__ __forceinline__ float load_f16(const unsigned char* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// N contiguous elements as one aligned load (at most 16 bytes: the widest a GPU load takes).
template <typename T, int N> struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Run {
    T v[N];
};

// A lane's share of a step: G runs of W contiguous values, run g from value start[g] of the
// step, each value scale[g] * q[g][i] + offset[g].
template <int G, int W> struct Share {
    int start[G];
    float scale[G], offset[G];
    float q[G][W];
};

// Blocks of 32: lane L takes block L / 4 of the step's 8 (false past the row's end).
struct Q8_0 {
    static constexpr int VALUES = 32, BYTES = 34, G = 1, W = 8;
    static constexpr bool OFFSET = false;
    __device__ static bool share(const unsigned char* row, int blocks, int step, int lane, Share<G, W>& s) {
        int b = step * 8 + lane / 4, j = lane % 4;
        if (b >= blocks) return false;
        const unsigned char* p = row + size_t(b) * BYTES;
        s.start[0] = (lane / 4) * 32 + 8 * j;
        s.scale[0] = load_f16(p);
        s.offset[0] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            unsigned pair = load_u16(p + 2 + 8 * j + 2 * i);
            s.q[0][2 * i] = float((signed char)(pair & 0xffu));
            s.q[0][2 * i + 1] = float((signed char)(pair >> 8));
        }
        return true;
    }
};

// Blocks of nibbles: byte i holds value i in its low nibble and value VALUES / 2 + i in its high
// one. Q4_0 (d, codes q - 8), Q4_1 (d, m: d q + m) and the int4 blocks of AWQ and GPTQ checkpoints
// (model/quant/awq_gptq.py: d, the zero z as a float16 integer, d (q - z), exact in fp32) of 32 or
// 128 values. Lane L takes bytes 4j .. 4j + 3 of block L / (VALUES / 8) of the step (j = L %
// (VALUES / 8)): values 4j .. 4j + 3 and VALUES / 2 + 4j ...
enum Zero { EIGHT, MINIMUM, STORED };
template <int VALUES_, int BYTES_, Zero ZERO> struct Nibbles {
    static constexpr int VALUES = VALUES_, BYTES = BYTES_, G = 2, W = 4, LANES = VALUES / 8;
    static constexpr bool OFFSET = ZERO == MINIMUM;
    __device__ static bool share(const unsigned char* row, int blocks, int step, int lane, Share<G, W>& s) {
        int b = step * (STEP / VALUES) + lane / LANES, j = lane % LANES;
        if (b >= blocks) return false;
        const unsigned char* p = row + size_t(b) * BYTES;
        float d = load_f16(p), second = ZERO == EIGHT ? 8.0f : load_f16(p + 2);
        const unsigned char* qs = p + (ZERO == EIGHT ? 2 : 4) + 4 * j;
        unsigned word = load_u16(qs) | load_u16(qs + 2) << 16;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            s.start[h] = (lane / LANES) * VALUES + (VALUES / 2) * h + 4 * j;
            s.scale[h] = d;
            s.offset[h] = OFFSET ? second : 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float code = float((word >> (8 * i + 4 * h)) & 15);
                s.q[h][i] = OFFSET ? code : code - second;  // exact: small integers
            }
        }
        return true;
    }
};
using Q4_0 = Nibbles<32, 18, EIGHT>;
using Q4_1 = Nibbles<32, 20, MINIMUM>;
using INT4_32 = Nibbles<32, 20, STORED>;
using INT4_128 = Nibbles<128, 68, STORED>;

// An e4m3 code's value, exactly: common.cuh's to_float without its int-to-float conversion (with
// it ptxas spilled 4 bytes at sm_80's 32 registers for 16-bit activations). The 7 magnitude bits
// under a float32's exponent and mantissa, the exponent rebiased (7 -> 127); a subnormal (exponent
// 0) as 2^-6 (1 + m / 8) - 2^-6 = m 2^-9, so no float32 subnormal is ever made; 0x7f NaN.
__device__ __forceinline__ float e4m3_value(unsigned code) {
    unsigned bits = (code & 0x7fu) << 20;
    float magnitude = code & 0x78u ? __uint_as_float(bits + (120u << 23))
                                   : __uint_as_float(bits | (121u << 23)) - 0.015625f;
    magnitude = (code & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : magnitude;
    return __uint_as_float(__float_as_uint(magnitude) | (code & 0x80u) << 24);
}

// FP8 (e4m3) checkpoints' weights as the blocks of 32 or 128 they are repacked into at load
// (model/quant/e4m3.py): a float32 scale, then the codes in order; a weight is scale x its e4m3
// value, one fp32 product, as model/quant/fp8.py dequantizes it (W8A16: no FP8 tensor cores
// needed). Lane L takes codes 8j .. 8j + 7 of block L / (VALUES / 8) of the step (j = L %
// (VALUES / 8)), two 4-byte loads (blocks of 36 and 132 bytes keep them aligned).
template <int VALUES_> struct E4m3 {
    static constexpr int VALUES = VALUES_, BYTES = 4 + VALUES, G = 1, W = 8, LANES = VALUES / 8;
    static constexpr bool OFFSET = false;
    __device__ static bool share(const unsigned char* row, int blocks, int step, int lane, Share<G, W>& s) {
        int b = step * (STEP / VALUES) + lane / LANES, j = lane % LANES;
        if (b >= blocks) return false;
        const unsigned char* p = row + size_t(b) * BYTES;
        s.start[0] = (lane / LANES) * VALUES + 8 * j;
        s.scale[0] = __uint_as_float(load_u32(p));
        s.offset[0] = 0.0f;
        unsigned words[2] = {load_u32(p + 4 + 8 * j), load_u32(p + 8 + 8 * j)};
#pragma unroll
        for (int i = 0; i < 8; ++i) s.q[0][i] = e4m3_value(words[i / 4] >> (8 * (i % 4)));
        return true;
    }
};
using FP8_32 = E4m3<32>;
using FP8_128 = E4m3<128>;

// Q4_K and Q5_K: d, dmin, 12 bytes of 6-bit sub-block scales and minimums, (Q5_K: 32 bytes of
// fifth bits,) 128 bytes of nibbles: chunk c's 32 bytes hold sub-block 2c low and 2c + 1 high.
// Lane L takes bytes 4j .. 4j + 3 of chunk L / 8 (j = L % 8): a run of 4 in each sub-block.
template <bool FIFTH> struct AffineK {
    static constexpr int VALUES = 256, BYTES = FIFTH ? 176 : 144, G = 2, W = 4;
    static constexpr bool OFFSET = true;
    __device__ static bool share(const unsigned char* row, int blocks, int step, int lane, Share<G, W>& s) {
        const unsigned char* p = row + size_t(step) * BYTES;
        int c = lane / 8, j = lane % 8;
        float d = load_f16(p), dmin = load_f16(p + 2);
        const unsigned char* scales = p + 4;
        unsigned codes = load_u32(p + (FIFTH ? 48 : 16) + 32 * c + 4 * j);
        unsigned fifth = FIFTH ? load_u32(p + 16 + 4 * j) : 0u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int sub = 2 * c + h, sc, m;
            if (sub < 4) {
                sc = scales[sub] & 63;
                m = scales[sub + 4] & 63;
            } else {
                sc = (scales[sub + 4] & 15) | ((scales[sub - 4] >> 6) << 4);
                m = (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4);
            }
            s.start[h] = 32 * sub + 4 * j;
            s.scale[h] = d * float(sc);
            s.offset[h] = -(dmin * float(m));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int code = (codes >> (8 * i + 4 * h)) & 15;
                if (FIFTH) code |= ((fifth >> (8 * i + sub)) & 1) << 4;
                s.q[h][i] = float(code);
            }
        }
        return true;
    }
};
using Q4_K = AffineK<false>;
using Q5_K = AffineK<true>;

// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values), d.
// Half n (128 values) of the super-block: low byte l and l + 32 and bit-pair byte l give values
// l, 32 + l, 64 + l and 96 + l. Lane L takes l = 2 (L % 16), l + 1 of half L / 16: 4 runs of 2.
struct Q6_K {
    static constexpr int VALUES = 256, BYTES = 210, G = 4, W = 2;
    static constexpr bool OFFSET = false;
    __device__ static bool share(const unsigned char* row, int blocks, int step, int lane, Share<G, W>& s) {
        const unsigned char* p = row + size_t(step) * BYTES;
        int n = lane / 16, l = 2 * (lane % 16);
        float d = load_f16(p + 208);
        unsigned low[2] = {load_u16(p + 64 * n + l), load_u16(p + 64 * n + 32 + l)};
        unsigned high = load_u16(p + 128 + 32 * n + l);
        const unsigned char* scales = p + 192 + 8 * n + l / 16;
#pragma unroll
        for (int g = 0; g < 4; ++g) {  // value 32g + l: low byte (g & 1), nibble g / 2, bit pair g
            s.start[g] = 128 * n + 32 * g + l;
            s.scale[g] = d * float((signed char)scales[2 * g]);
            s.offset[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                int code = ((low[g & 1] >> (8 * i + 4 * (g / 2))) & 15) | (((high >> (8 * i + 2 * g)) & 3) << 4);
                s.q[g][i] = float(code - 32);
            }
        }
        return true;
    }
};

template <typename T, bool FP32> struct Output {
    using type = T;
};
template <typename T> struct Output<T, true> {
    using type = float;
};

template <typename T, typename Q, int FP32_OUT>
__global__ __launch_bounds__(128) void dequant_gemv(typename Output<T, FP32_OUT>::type* __restrict__ out,
                                                    const T* __restrict__ x, const unsigned char* __restrict__ w,
                                                    const T* __restrict__ bias, int rows, int n, int k,
                                                    int out_width, int first) {
    int lane = threadIdx.x & 31, wrow = blockIdx.x * BLOCK_WARPS + (threadIdx.x >> 5);
    int r0 = blockIdx.y * BLOCK_ROWS, count = min(BLOCK_ROWS, rows - r0);
    if (wrow >= n) return;  // the whole warp: no shuffle below is left half-done
    int blocks = k / Q::VALUES;
    const unsigned char* row = w + size_t(wrow) * blocks * Q::BYTES;
    const T* xs = x + size_t(r0) * k;
    float acc[BLOCK_ROWS];
#pragma unroll
    for (int r = 0; r < BLOCK_ROWS; ++r) acc[r] = 0.0f;
    for (int step = 0; step * STEP < k; ++step) {
        Share<Q::G, Q::W> s;
        if (!Q::share(row, blocks, step, lane, s)) continue;
#pragma unroll
        for (int r = 0; r < BLOCK_ROWS; ++r) {
            if (r >= count) break;
            const T* at = xs + size_t(r) * k + step * STEP;
            float sum = 0.0f;
#pragma unroll
            for (int g = 0; g < Q::G; ++g) {
                Run<T, Q::W> v = *reinterpret_cast<const Run<T, Q::W>*>(at + s.start[g]);
                float dot = 0.0f, plain = 0.0f;
#pragma unroll
                for (int i = 0; i < Q::W; ++i) {
                    float xi = to_float(v.v[i]);
                    dot += s.q[g][i] * xi;
                    if (Q::OFFSET) plain += xi;
                }
                sum += s.scale[g] * dot;
                if (Q::OFFSET) sum += s.offset[g] * plain;
            }
            acc[r] += sum;
        }
    }
#pragma unroll
    for (int r = 0; r < BLOCK_ROWS; ++r) {
        if (r >= count) break;  // count is the block's: every lane of the warp leaves together
        float total = warp_sum(acc[r]);
        if (lane == 0) {
            if (bias) total += to_float(bias[wrow]);
            out[size_t(r0 + r) * out_width + first + wrow] = from_float<typename Output<T, FP32_OUT>::type>(total);
        }
    }
}

template <typename T, typename Q>
__global__ __launch_bounds__(128) void dequant_rows(T* __restrict__ out, const unsigned char* __restrict__ w,
                                                    const int* __restrict__ ids, int n, int k, int first,
                                                    float scale) {
    int wrow = ids ? ids[blockIdx.x] : first + int(blockIdx.x);
    T* dst = out + size_t(blockIdx.x) * k;
    if (wrow < 0 || wrow >= n) {
        for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = from_float<T>(0.0f);
        return;
    }
    int blocks = k / Q::VALUES, lane = threadIdx.x & 31;
    const unsigned char* row = w + size_t(wrow) * blocks * Q::BYTES;
    for (int step = threadIdx.x >> 5; step * STEP < k; step += blockDim.x >> 5) {
        Share<Q::G, Q::W> s;
        if (!Q::share(row, blocks, step, lane, s)) continue;
#pragma unroll
        for (int g = 0; g < Q::G; ++g) {
            Run<T, Q::W> v;
#pragma unroll
            for (int i = 0; i < Q::W; ++i) {
                float value = s.scale[g] * s.q[g][i];
                if (Q::OFFSET) value += s.offset[g];  // not + 0 where none: -0 stays -0, as the reference's
                v.v[i] = from_float<T>(scale == 1.0f ? value : value * scale);
            }
            *reinterpret_cast<Run<T, Q::W>*>(dst + step * STEP + s.start[g]) = v;
        }
    }
}
