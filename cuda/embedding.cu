// The embedding gather: out[t, :] = table[ids[t], :], one block per token.
#include "common.cuh"

template <typename T>
__global__ void embedding(T* __restrict__ out, const T* __restrict__ table, const int* __restrict__ ids, int hidden) {
    const T* src = table + size_t(ids[blockIdx.x]) * hidden;
    T* dst = out + size_t(blockIdx.x) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}
