// Logprobs of the raw distribution (before penalties and temperature, as vLLM reports them),
// one block per row: the sampled token's, and the row's top n, in order of logprob descending
// then id ascending (numpy_ops.sample's order). Each of the n rounds is a block-wide argmax over
// the tokens that come after the previous pick in that order, so nothing is sorted.
// Block size: a multiple of 32.
#include "common.cuh"

// The better of two (value, id) candidates: the larger value, then the smaller id.
__device__ __forceinline__ void better(float& v, int& id, float v2, int id2) {
    if (v2 > v || (v2 == v && id2 < id)) {
        v = v2;
        id = id2;
    }
}

__device__ __forceinline__ void block_best(float& v, int& id) {
    __shared__ float s_v[32];
    __shared__ int s_id[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) better(v, id, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, id, o));
    if (lane == 0) {
        s_v[warp] = v;
        s_id[warp] = id;
    }
    __syncthreads();
    if (warp == 0) {
        bool live = lane < int(blockDim.x >> 5);
        v = live ? s_v[lane] : neg_inf();
        id = live ? s_id[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) better(v, id, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, id, o));
        if (lane == 0) {
            s_v[0] = v;
            s_id[0] = id;
        }
    }
    __syncthreads();
    v = s_v[0];
    id = s_id[0];
    __syncthreads();
}

__global__ void logprobs(float* __restrict__ chosen, int* __restrict__ top_ids, float* __restrict__ top_values,
                         const float* __restrict__ logits, const int* __restrict__ tokens, const int* __restrict__ top_n,
                         int vocab, int max_n) {
    const float* row = logits + size_t(blockIdx.x) * vocab;
    float top = neg_inf();
    int top_id = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) better(top, top_id, row[i], i);
    block_best(top, top_id);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += __expf(row[i] - top);
    float log_total = top + __logf(block_sum(sum));
    int token = tokens[blockIdx.x];  // -1 where the sampler found no token: NaN, not a read outside the row
    bool known = token >= 0 && token < vocab;
    if (threadIdx.x == 0) chosen[blockIdx.x] = known ? row[token] - log_total : __int_as_float(0x7fc00000);

    float last_v = top;  // the previous pick, to find the next one after it
    int last_id = top_id;
    for (int k = 0; k < top_n[blockIdx.x]; ++k) {
        float v = top;
        int id = top_id;
        if (k > 0) {
            v = neg_inf();
            id = 0x7fffffff;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                if (row[i] < last_v || (row[i] == last_v && i > last_id)) better(v, id, row[i], i);
            block_best(v, id);
        }
        if (threadIdx.x == 0) {
            top_ids[size_t(blockIdx.x) * max_n + k] = id;
            top_values[size_t(blockIdx.x) * max_n + k] = v - log_total;
        }
        last_v = v;
        last_id = id;
    }
}
