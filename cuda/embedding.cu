// The embedding gather: out[t, :] = table[ids[t], :] * scale (Gemma's sqrt(hidden); 1 for the
// rest), one block per token. An id outside the
// table (the sampler's -1 for a row with no token, fed ahead to the next step) gives zeros: an
// illegal address would poison the whole CUDA context, and that row's request fails anyway.
#include "common.cuh"

template <typename T>
__global__ void embedding(T* __restrict__ out, const T* __restrict__ table, const int* __restrict__ ids, int hidden,
                          int vocab, float scale) {
    int id = ids[blockIdx.x];
    T* dst = out + size_t(blockIdx.x) * hidden;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = from_float<T>(0.0f);
        return;
    }
    const T* src = table + size_t(id) * hidden;
    if (scale == 1.0f) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
        return;
    }
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = from_float<T>(to_float(src[i]) * scale);
}
