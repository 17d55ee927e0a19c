// LoRA's two small products per token (model/lora.py), each token reading its own adapter's slot
// (Punica's BGMV): y[t, first + o] += sum_r b[s, o, r] * (scales[t] * sum_k a[s, r, k] * x[t, k]),
// s = slots[t]; a token of slot -1 (the base model) is left as it was.
//
// lora_shrink: a block per token, a warp per rank (then the next rank a warp's count on), the
// lanes over the input, summed by a warp reduction; fp32 into shrunk (tokens, rank), a scratch
// buffer. lora_expand: a thread per output column, the sum over the ranks in order, added to y
// read as fp32 and rounded to the storage type once. Every sum of a token runs in one fixed order
// set by the shapes alone, so a token's row is the same bits alone and in a batch. No atomics.
// The adapters' weights are fp32 (a (slots, rank, in), b (slots, out, rank)), zero-padded to the
// served rank.
#include "common.cuh"

template <typename T>
__global__ void lora_shrink(float* __restrict__ shrunk, const T* __restrict__ x, const float* __restrict__ a,
                            const int* __restrict__ slots, const float* __restrict__ scales, int width, int rank) {
    int t = blockIdx.x, s = slots[t];
    if (s < 0) return;  // the whole block: no barrier below
    const T* row = x + size_t(t) * width;
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int r = threadIdx.x >> 5; r < rank; r += warps) {  // warp-uniform: every lane shuffles
        const float* weights = a + (size_t(s) * rank + r) * width;
        float total = 0.0f;
        for (int k = lane; k < width; k += 32) total += weights[k] * to_float(row[k]);
        total = warp_sum(total);
        if (lane == 0) shrunk[size_t(t) * rank + r] = total * scales[t];
    }
}

template <typename T>
__global__ void lora_expand(T* __restrict__ y, const float* __restrict__ shrunk, const float* __restrict__ b,
                            const int* __restrict__ slots, int out, int rank, int y_width, int first) {
    int t = blockIdx.y, s = slots[t], o = blockIdx.x * blockDim.x + threadIdx.x;
    if (s < 0 || o >= out) return;
    const float* weights = b + (size_t(s) * out + o) * rank;
    const float* mine = shrunk + size_t(t) * rank;
    float total = 0.0f;
    for (int r = 0; r < rank; ++r) total += weights[r] * mine[r];
    T* dst = y + size_t(t) * y_width + first + o;
    *dst = from_float<T>(to_float(*dst) + total);
}
