// What every Spool kernel shares: storage types to and from fp32, and warp and block reductions.
// Kept to the CUDA subset in README.md, so the CPU shim runs the same source.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// An fp8 K/V cache (--kv-cache-dtype fp8): OCP FP8 E4M3 (1 sign, 4 exponent bits of bias 7, 3
// mantissa bits; no infinities, S.1111.111 is NaN, 448 the largest finite). Spool's own type and
// conversions rather than <cuda_fp8.h>'s, so the CPU shim and nvcc run the same code, bit for bit
// (the results are those of __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) and its inverse).
struct spool_fp8_e4m3 {
    unsigned char bits;
};

// x rounded to e4m3 to nearest even, saturating: past 448 (infinities too) is +-448; NaN is
// 0x7f; float32 subnormals are +-0.
__device__ __forceinline__ spool_fp8_e4m3 to_fp8_e4m3(float x) {
    unsigned u = __float_as_uint(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return {0x7f};
    if (a >= 0x43e00000u) return {(unsigned char)(sign | 0x7eu)};  // 448 and up: the largest finite
    if (a >= 0x3c800000u) {  // 2^-6 and up: normal; rebias 127 -> 7 and round 23 mantissa bits to 3
        unsigned r = a - (120u << 23);
        return {(unsigned char)(sign | ((r + 0x7ffffu + ((r >> 20) & 1u)) >> 20))};
    }
    if (a < 0x00800000u) return {(unsigned char)sign};
    // subnormal: |x| / 2^-9 rounded to nearest even, 0 to 8 (8 is the smallest normal, 0x08)
    unsigned m = (a & 0x7fffffu) | 0x800000u, shift = 14u + 127u - (a >> 23);  // 21 and up
    if (shift > 31u) return {(unsigned char)sign};
    unsigned q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return {(unsigned char)(sign | (q + (rest > half || (rest == half && (q & 1u)))))};
}

__device__ __forceinline__ float to_float(spool_fp8_e4m3 x) {  // exact: every e4m3 value is a float
    unsigned e = (x.bits >> 3) & 15u, m = x.bits & 7u;
    float magnitude = (x.bits & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u)
                      : e ? __uint_as_float(((e + 120u) << 23) | (m << 20))
                          : float(m) * 0.001953125f;  // m 2^-9
    return x.bits & 0x80u ? -magnitude : magnitude;
}

// A K/V cache's element type C (a template argument of the kernels that read or write a cache):
// the storage type itself, rows of head_dim; or spool_fp8_e4m3, rows of head_dim values then
// their float32 scale (4 bytes, aligned: head_dim is a multiple of 4), value = e4m3 times scale.
template <typename C> struct KvCache {
    static constexpr bool scaled = false;
    __device__ static __forceinline__ int width(int head_dim) { return head_dim; }
};
template <> struct KvCache<spool_fp8_e4m3> {
    static constexpr bool scaled = true;
    __device__ static __forceinline__ int width(int head_dim) { return head_dim + 4; }
};

// A scaled row's scale: the float32 after its head_dim values.
template <typename C> __device__ __forceinline__ float row_scale(const C* row, int head_dim) {
    return *reinterpret_cast<const float*>(row + head_dim);
}

// Element d of the cache row starting at `row`, as float (times the row's scale where scaled).
template <typename C> __device__ __forceinline__ float kv_value(const C* cache, size_t row, int d, int head_dim) {
    if constexpr (KvCache<C>::scaled) return to_float(cache[row + d]) * row_scale(cache + row, head_dim);
    else return to_float(cache[row + d]);
}

// A kernel's dynamic shared memory (the launch's shared_mem bytes) as a T*, 32-byte aligned; the
// CPU shim defines its own (cuda/README.md).
#ifndef SPOOL_DYNAMIC_SMEM
#define SPOOL_DYNAMIC_SMEM(T, name)                              \
    extern __shared__ __align__(32) unsigned char spool_smem[]; \
    T* name = reinterpret_cast<T*>(spool_smem)
#endif

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// An online softmax before its first key, for each of a thread's R rows: the running max at -inf,
// the running sum and the D accumulated values at zero (the attention kernels' split state).
template <int R, int D>
__device__ __forceinline__ void softmax_start(float (&acc)[R][D], float (&run_max)[R], float (&run_sum)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
        run_max[i] = neg_inf();
        run_sum[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < D; ++j) acc[i][j] = 0.0f;
    }
}

// Four contiguous elements, aligned as one load: 8 bytes for the 16-bit types, 16 for fp32.
// An element offset that is a multiple of 4 from an array's start (allocations are 256-aligned
// on a GPU, 16 in NumPy) is aligned for it.
template <typename T> struct alignas(sizeof(T) * 4) Four {
    T v[4];
};

struct Sum {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename Op> __device__ __forceinline__ float warp_reduce(float v, Op op) {
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// The reduction over the block, in every thread; identity is op's (0 for Sum, -inf for Max).
// blockDim.x must be a multiple of 32.
template <typename Op> __device__ __forceinline__ float block_reduce(float v, float identity, Op op) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < int(blockDim.x >> 5) ? partial[lane] : identity;
        v = warp_reduce(v, op);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    v = partial[0];
    __syncthreads();  // partial is reused by the next call
    return v;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, Sum()); }
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.0f, Sum()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, neg_inf(), Max()); }
