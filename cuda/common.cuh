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

// A kernel's dynamic shared memory (the launch's shared_mem bytes) as a T*, 32-byte aligned; the
// CPU shim defines its own (cuda/README.md).
#ifndef SPOOL_DYNAMIC_SMEM
#define SPOOL_DYNAMIC_SMEM(T, name)                              \
    extern __shared__ __align__(32) unsigned char spool_smem[]; \
    T* name = reinterpret_cast<T*>(spool_smem)
#endif

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

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
