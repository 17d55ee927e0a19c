// RMSNorm over the last dimension, one block per row, the sum of squares in fp32.
// add_rms_norm fuses the residual add before it: residual += x, out = norm(residual) * weight,
// reading x and the residual once and writing each once.
//
// Rows go four elements a load (Four: 8 bytes for the 16-bit types) and stay in registers
// between the sum of squares and the scaling, up to RMS_HELD fours a thread (4096 elements at
// 128 threads); a longer row's rest is read again. Rows of a length not a multiple of 4 do not
// start aligned, and go an element at a time.
#include "common.cuh"

#define RMS_HELD 8

// dst = row * scale * weight: the fours this thread holds from the first pass, then the rest of
// the row read again.
template <typename T>
__device__ __forceinline__ void scale_row(T* dst, const T* row, const T* weight, int hidden, float scale,
                                          const Four<T>* held) {
    int fours = hidden % 4 ? 0 : hidden / 4;  // fours only where every row starts aligned
#pragma unroll
    for (int k = 0; k < RMS_HELD; ++k) {
        int f = threadIdx.x + k * blockDim.x;
        if (f >= fours) break;
        Four<T> w = reinterpret_cast<const Four<T>*>(weight)[f], out;
#pragma unroll
        for (int j = 0; j < 4; ++j) out.v[j] = from_float<T>(to_float(held[k].v[j]) * scale * to_float(w.v[j]));
        reinterpret_cast<Four<T>*>(dst)[f] = out;
    }
    for (int f = threadIdx.x + RMS_HELD * blockDim.x; f < fours; f += blockDim.x) {
        Four<T> x = reinterpret_cast<const Four<T>*>(row)[f], w = reinterpret_cast<const Four<T>*>(weight)[f], out;
#pragma unroll
        for (int j = 0; j < 4; ++j) out.v[j] = from_float<T>(to_float(x.v[j]) * scale * to_float(w.v[j]));
        reinterpret_cast<Four<T>*>(dst)[f] = out;
    }
    for (int i = fours * 4 + threadIdx.x; i < hidden; i += blockDim.x)
        dst[i] = from_float<T>(to_float(row[i]) * scale * to_float(weight[i]));
}

// The residual add of four elements, written back; the sum of squares of the sums added up.
template <typename T>
__device__ __forceinline__ Four<T> add_four(T* row, const T* delta, int f, float& squares) {
    Four<T> a = reinterpret_cast<const Four<T>*>(row)[f], b = reinterpret_cast<const Four<T>*>(delta)[f], sum;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        sum.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
        squares += to_float(sum.v[j]) * to_float(sum.v[j]);
    }
    reinterpret_cast<Four<T>*>(row)[f] = sum;
    return sum;
}

template <typename T>
__global__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int hidden,
                         float eps) {
    const T* row = x + size_t(blockIdx.x) * hidden;
    int fours = hidden % 4 ? 0 : hidden / 4;  // fours only where every row starts aligned
    Four<T> held[RMS_HELD];
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_HELD; ++k) {
        int f = threadIdx.x + k * blockDim.x;
        held[k] = f < fours ? reinterpret_cast<const Four<T>*>(row)[f] : Four<T>{};
#pragma unroll
        for (int j = 0; j < 4; ++j) squares += to_float(held[k].v[j]) * to_float(held[k].v[j]);
    }
    for (int f = threadIdx.x + RMS_HELD * blockDim.x; f < fours; f += blockDim.x) {
        Four<T> v = reinterpret_cast<const Four<T>*>(row)[f];
#pragma unroll
        for (int j = 0; j < 4; ++j) squares += to_float(v.v[j]) * to_float(v.v[j]);
    }
    for (int i = fours * 4 + threadIdx.x; i < hidden; i += blockDim.x) squares += to_float(row[i]) * to_float(row[i]);
    float scale = rsqrtf(block_sum(squares) / float(hidden) + eps);
    scale_row(out + size_t(blockIdx.x) * hidden, row, weight, hidden, scale, held);
}

template <typename T>
__global__ void add_rms_norm(T* __restrict__ out, T* __restrict__ residual, const T* __restrict__ x,
                             const T* __restrict__ weight, int hidden, float eps) {
    size_t base = size_t(blockIdx.x) * hidden;
    T* row = residual + base;
    const T* delta = x + base;
    int fours = hidden % 4 ? 0 : hidden / 4;  // fours only where every row starts aligned
    Four<T> held[RMS_HELD];
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_HELD; ++k) {
        int f = threadIdx.x + k * blockDim.x;
        held[k] = f < fours ? add_four(row, delta, f, squares) : Four<T>{};
    }
    for (int f = threadIdx.x + RMS_HELD * blockDim.x; f < fours; f += blockDim.x) add_four(row, delta, f, squares);
    for (int i = fours * 4 + threadIdx.x; i < hidden; i += blockDim.x) {
        T sum = from_float<T>(to_float(row[i]) + to_float(delta[i]));
        row[i] = sum;
        squares += to_float(sum) * to_float(sum);
    }
    float scale = rsqrtf(block_sum(squares) / float(hidden) + eps);
    scale_row(out + base, row, weight, hidden, scale, held);
}
