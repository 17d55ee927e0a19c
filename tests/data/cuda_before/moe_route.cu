// The MoE routing kernels that cuda/moe.cu's moe_router and moe_topk replaced (Spool before issue
// 51), kept verbatim for tests/test_moe_router.py: the new kernels must route to the same experts
// with the same weights, to the bit. Built only by that test, through the CPU harness.
#include "common.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_TILE_ROWS 16

// One block per token: the router's logits (a warp per expert at a time, lanes along hidden),
// their softmax, the top k by k argmax passes (ties to the lower id), renormalised to sum to 1
// where normalize is set. router (and router_bias, or null) is fp32 whatever the storage type.
template <typename T>
__global__ void moe_route(int* __restrict__ ids, float* __restrict__ weights, const T* __restrict__ x,
                          const float* __restrict__ router, const float* __restrict__ router_bias, int hidden,
                          int experts, int top_k, int normalize) {
    __shared__ float logits[MOE_MAX_EXPERTS];
    const T* row = x + size_t(blockIdx.x) * hidden;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int e = warp; e < experts; e += warps) {
        const float* w = router + size_t(e) * hidden;
        float dot = 0.0f;
        for (int i = lane; i < hidden; i += 32) dot += to_float(row[i]) * w[i];
        dot = warp_sum(dot);
        if (lane == 0) logits[e] = router_bias ? dot + router_bias[e] : dot;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    float top = neg_inf(), total = 0.0f;
    for (int e = 0; e < experts; ++e) top = fmaxf(top, logits[e]);
    for (int e = 0; e < experts; ++e) {
        logits[e] = expf(logits[e] - top);
        total += logits[e];
    }
    int* my_ids = ids + size_t(blockIdx.x) * top_k;
    float* my_weights = weights + size_t(blockIdx.x) * top_k;
    float chosen = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        int best = 0;
        for (int e = 1; e < experts; ++e)
            if (logits[e] > logits[best]) best = e;
        my_ids[j] = best;
        my_weights[j] = logits[best] / total;
        chosen += my_weights[j];
        logits[best] = -1.0f;  // below every probability: not chosen twice
    }
    if (normalize)
        for (int j = 0; j < top_k; ++j) my_weights[j] /= chosen;
}

// One block: the routed rows (token t's choice j at t x top_k + j) sorted by expert, tokens in
// order within one. starts[e]: expert e's first sorted row (starts[experts]: all of them);
// tile_starts[e]: its first GEMM tile of MOE_TILE_ROWS rows; tokens_of[s]: sorted row s's
// token; position[r]: where routed row r went.
__global__ void moe_align(int* __restrict__ starts, int* __restrict__ tile_starts, int* __restrict__ tokens_of,
                          int* __restrict__ position, const int* __restrict__ ids, int routed, int top_k,
                          int experts) {
    __shared__ int counts[MOE_MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int n = 0;
        for (int r = 0; r < routed; ++r) n += ids[r] == e;
        counts[e] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int row = 0, tile = 0;
        for (int e = 0; e < experts; ++e) {
            int n = counts[e];
            starts[e] = counts[e] = row;
            tile_starts[e] = tile;
            row += n;
            tile += (n + MOE_TILE_ROWS - 1) / MOE_TILE_ROWS;
        }
        starts[experts] = row;
        tile_starts[experts] = tile;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int at = counts[e];
        for (int r = 0; r < routed; ++r)
            if (ids[r] == e) {
                tokens_of[at] = r / top_k;
                position[r] = at++;
            }
    }
}
