// RMSNorm over the last dimension, one block per row, the sum of squares in fp32.
// add_rms_norm fuses the residual add before it: residual += x, out = norm(residual) * weight,
// reading x and the residual once and writing each once (the second pass re-reads the residual
// row just written, from cache).
#include "common.cuh"

template <typename T>
__global__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int hidden,
                         float eps) {
    const T* row = x + size_t(blockIdx.x) * hidden;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = to_float(row[i]);
        squares += v * v;
    }
    float scale = rsqrtf(block_sum(squares) / float(hidden) + eps);
    T* dst = out + size_t(blockIdx.x) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        dst[i] = from_float<T>(to_float(row[i]) * scale * to_float(weight[i]));
}

template <typename T>
__global__ void add_rms_norm(T* __restrict__ out, T* __restrict__ residual, const T* __restrict__ x,
                             const T* __restrict__ weight, int hidden, float eps) {
    size_t base = size_t(blockIdx.x) * hidden;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        T sum = from_float<T>(to_float(residual[base + i]) + to_float(x[base + i]));
        residual[base + i] = sum;
        float v = to_float(sum);
        squares += v * v;
    }
    float scale = rsqrtf(block_sum(squares) / float(hidden) + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[base + i] = from_float<T>(to_float(residual[base + i]) * scale * to_float(weight[i]));
}
