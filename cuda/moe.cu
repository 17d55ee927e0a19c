// A mixture of experts in four launches, sized by the step's token count only (so a CUDA graph
// captures them): route each token to its top k experts, sort the routed rows by expert on the
// device, multiply each expert's rows by its weights as tiles of one grouped GEMM (every expert
// in one launch, never a launch or a pass per token), and sum each token's k outputs.
//
// The experts' weights are stacked along their rows (expert e's n rows from e x n, as
// model/weights.py's Experts keeps them). Every row's arithmetic is its own, in a fixed order,
// so a token's output does not depend on what else is in the step.
#include "common.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_TILE_ROWS 16   // routed rows a GEMM block takes, all of one expert
#define MOE_TILE_COLS 64   // output columns a GEMM block takes
#define MOE_TILE_K 32      // the inner dimension a shared tile holds

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

// out[s, c] = in[row s] . w[e x n + c] for sorted row s of expert e, where in's row is
// tokens_of[s] (gather: the tokens themselves) or s (rows already sorted). Block (x, y): output
// columns x x 64 .., the y-th tile of MOE_TILE_ROWS rows of one expert (found from
// tile_starts; blocks past the last tile return). 128 threads: column threadIdx.x % 64, rows
// threadIdx.x / 64 + 2i; each output summed along k in order, in fp32, then the expert's bias
// added (fp32, experts x n; or null).
template <typename T>
__global__ void moe_gemm(T* __restrict__ out, const T* __restrict__ in, const T* __restrict__ w,
                         const float* __restrict__ bias, const int* __restrict__ starts, const int* __restrict__ tile_starts,
                         const int* __restrict__ tokens_of, int gather, int n, int k, int experts) {
    __shared__ float xs[MOE_TILE_ROWS][MOE_TILE_K];
    __shared__ float ws[MOE_TILE_COLS][MOE_TILE_K + 1];
    int tile = blockIdx.y;
    if (tile >= tile_starts[experts]) return;
    int e = 0;
    while (tile_starts[e + 1] <= tile) ++e;
    int first = starts[e] + (tile - tile_starts[e]) * MOE_TILE_ROWS;
    int rows = min(MOE_TILE_ROWS, starts[e + 1] - first);
    int col0 = blockIdx.x * MOE_TILE_COLS, col = threadIdx.x % MOE_TILE_COLS, half = threadIdx.x / MOE_TILE_COLS;
    const T* we = w + size_t(e) * n * k;
    float acc[MOE_TILE_ROWS / 2];
#pragma unroll
    for (int i = 0; i < MOE_TILE_ROWS / 2; ++i) acc[i] = 0.0f;
    for (int k0 = 0; k0 < k; k0 += MOE_TILE_K) {
        for (int i = threadIdx.x; i < MOE_TILE_ROWS * MOE_TILE_K; i += blockDim.x) {
            int r = i / MOE_TILE_K, kk = k0 + i % MOE_TILE_K;
            float v = 0.0f;
            if (r < rows && kk < k) {
                int src = gather ? tokens_of[first + r] : first + r;
                v = to_float(in[size_t(src) * k + kk]);
            }
            xs[r][i % MOE_TILE_K] = v;
        }
        for (int i = threadIdx.x; i < MOE_TILE_COLS * MOE_TILE_K; i += blockDim.x) {
            int c = i / MOE_TILE_K, kk = k0 + i % MOE_TILE_K;
            ws[c][i % MOE_TILE_K] = col0 + c < n && kk < k ? to_float(we[size_t(col0 + c) * k + kk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MOE_TILE_ROWS / 2; ++i) {
            int r = half + 2 * i;
            float sum = acc[i];
            for (int kk = 0; kk < MOE_TILE_K; ++kk) sum += xs[r][kk] * ws[col][kk];
            acc[i] = sum;
        }
        __syncthreads();
    }
    if (col0 + col >= n) return;
    float added = bias ? bias[size_t(e) * n + col0 + col] : 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_TILE_ROWS / 2; ++i) {
        int r = half + 2 * i;
        if (r < rows) out[size_t(first + r) * n + col0 + col] = from_float<T>(acc[i] + added);
    }
}

// One block per token: out[t] = sum over its choices j, in order, of weights[t, j] times the
// expert's output row position[t x top_k + j].
template <typename T>
__global__ void moe_combine(T* __restrict__ out, const T* __restrict__ routed, const float* __restrict__ weights,
                            const int* __restrict__ position, int hidden, int top_k) {
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j)
            sum += weights[t * top_k + j] * to_float(routed[size_t(position[t * top_k + j]) * hidden + i]);
        out[size_t(t) * hidden + i] = from_float<T>(sum);
    }
}

// One block per token: out[t] += sigmoid(x[t] . gate) * shared[t], a shared expert's output
// gated by its own one-row projection (fp32 weights, as the router's) and added to the routed
// experts' sum.
template <typename T>
__global__ void moe_shared_add(T* __restrict__ out, const T* __restrict__ shared, const T* __restrict__ x,
                               const float* __restrict__ gate, int hidden) {
    size_t row = size_t(blockIdx.x) * hidden;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dot += to_float(x[row + i]) * gate[i];
    float weight = 1.0f / (1.0f + __expf(-block_sum(dot)));
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = from_float<T>(to_float(out[row + i]) + weight * to_float(shared[row + i]));
}
