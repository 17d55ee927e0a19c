// A mixture of experts in five launches, sized by the step's token count only (so a CUDA graph
// captures them): the router's logits as one GEMM, each token's top k experts with the routed
// rows then sorted by expert on the device, each expert's rows multiplied by its weights as
// tiles of one grouped GEMM (every expert in one launch, never a launch or a pass per token),
// and each token's k outputs summed.
//
// The experts' weights are stacked along their rows (expert e's n rows from e x n, as
// model/weights.py's Experts keeps them). Every row's arithmetic is its own, in a fixed order,
// so a token's output does not depend on what else is in the step.
#include "common.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_TILE_ROWS 16   // routed rows a GEMM block takes, all of one expert
#define MOE_TILE_COLS 64   // output columns a GEMM block takes
#define MOE_TILE_K 32      // the inner dimension a shared tile holds

#define MOE_ROUTE_WARPS 4   // a router block's warps (128 threads): experts, or tokens, a block
#define MOE_ROUTE_TOKENS 8  // tokens a router warp takes, its router row read once for all of them

// The router's logits as one GEMM over the step's tokens, in blocks across the GPU (a block per 4
// experts and 8 tokens) where one block a token read the whole router (1 MB at 128 experts of
// 2048): logits[t, e] = x[t] . router[e] (+ router_bias[e]), fp32. Not cuBLAS: the router is fp32
// and x the storage type, which cublasGemmEx cannot mix, and each logit is summed as before
// (lanes along hidden, then the warp's sum), so a token's routing is the same bits whatever else
// is in the step. router (and router_bias, or null) is fp32 whatever the storage type.
template <typename T>
__global__ void moe_router(float* __restrict__ logits, const T* __restrict__ x, const float* __restrict__ router,
                           const float* __restrict__ router_bias, int tokens, int hidden, int experts) {
    int lane = threadIdx.x & 31, e = blockIdx.x * MOE_ROUTE_WARPS + (threadIdx.x >> 5);
    int t0 = blockIdx.y * MOE_ROUTE_TOKENS, n = min(MOE_ROUTE_TOKENS, tokens - t0);
    if (e >= experts) return;  // a whole warp
    const float* w = router + size_t(e) * hidden;
    const T* rows = x + size_t(t0) * hidden;
    float dot[MOE_ROUTE_TOKENS];
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_TOKENS; ++j) dot[j] = 0.0f;
    for (int i = lane; i < hidden; i += 32) {
        float wi = w[i];
#pragma unroll
        for (int j = 0; j < MOE_ROUTE_TOKENS; ++j)
            if (j < n) dot[j] += to_float(rows[size_t(j) * hidden + i]) * wi;
    }
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_TOKENS; ++j) {
        float sum = warp_sum(dot[j]);
        if (lane == 0 && j < n) logits[size_t(t0 + j) * experts + e] = router_bias ? sum + router_bias[e] : sum;
    }
}

// The routed rows (token t's choice j at t x top_k + j) sorted by expert, tokens in order within
// one, by one block. starts[e]: expert e's first sorted row (starts[experts]: all of them);
// tile_starts[e]: its first GEMM tile of MOE_TILE_ROWS rows; tokens_of[s]: sorted row s's token;
// position[r]: where routed row r went. ids are read volatile: other blocks wrote them.
__device__ void moe_align(int* __restrict__ starts, int* __restrict__ tile_starts, int* __restrict__ tokens_of,
                          int* __restrict__ position, const volatile int* ids, int routed, int top_k, int experts) {
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

// A warp per token: the softmax of its router logits (expf; their sum added in expert order by
// one lane, as one thread did), its top k by k warp argmaxes (ties to the lower id), each
// chosen weight its probability, renormalised to sum to 1 where normalize is set, then times its
// expert's expert_scale (fp32, or null: Gemma 4). The last block to finish (done counts blocks,
// zero at launch and left zero) then sorts the routed rows (moe_align), so routing stays two
// launches. 128 threads; at most MOE_MAX_EXPERTS experts.
__global__ void moe_topk(int* __restrict__ ids, float* __restrict__ weights, int* __restrict__ starts,
                         int* __restrict__ tile_starts, int* __restrict__ tokens_of, int* __restrict__ position,
                         unsigned* __restrict__ done, const float* __restrict__ logits,
                         const float* __restrict__ expert_scale, int tokens, int experts, int top_k, int normalize) {
    __shared__ float probs[MOE_ROUTE_WARPS][MOE_MAX_EXPERTS];
    __shared__ int last;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t < tokens) {  // warp-uniform
        const float* row = logits + size_t(t) * experts;
        float p[MOE_MAX_EXPERTS / 32], top = neg_inf();
#pragma unroll
        for (int j = 0; j < MOE_MAX_EXPERTS / 32; ++j) {
            int e = lane + 32 * j;
            p[j] = e < experts ? row[e] : neg_inf();
            top = fmaxf(top, p[j]);
        }
        for (int offset = 16; offset > 0; offset >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
#pragma unroll
        for (int j = 0; j < MOE_MAX_EXPERTS / 32; ++j) {
            int e = lane + 32 * j;
            if (e < experts) probs[warp][e] = p[j] = expf(p[j] - top);
        }
        __syncwarp();
        float total = 0.0f;
        if (lane == 0)
            for (int e = 0; e < experts; ++e) total += probs[warp][e];
        total = __shfl_sync(0xffffffffu, total, 0);
        int* my_ids = ids + size_t(t) * top_k;
        float* my_weights = weights + size_t(t) * top_k;
        float chosen = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            float best = p[0];  // this lane's, lowest id on ties; past experts: -inf, never chosen
            int id = lane;
#pragma unroll
            for (int i = 1; i < MOE_MAX_EXPERTS / 32; ++i)
                if (p[i] > best) {
                    best = p[i];
                    id = lane + 32 * i;
                }
            for (int offset = 16; offset > 0; offset >>= 1) {
                float other = __shfl_xor_sync(0xffffffffu, best, offset);
                int other_id = __shfl_xor_sync(0xffffffffu, id, offset);
                if (other > best || (other == best && other_id < id)) {
                    best = other;
                    id = other_id;
                }
            }
            float w = best / total;
            if (lane == 0) {
                my_ids[j] = id;
                my_weights[j] = w;
            }
            chosen += w;
#pragma unroll
            for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i)
                if (lane + 32 * i == id) p[i] = -1.0f;  // below every probability: not chosen twice
        }
        if (lane == 0)
            for (int j = 0; j < top_k; ++j) {
                float w = normalize ? my_weights[j] / chosen : my_weights[j];
                my_weights[j] = expert_scale ? w * expert_scale[my_ids[j]] : w;
            }
    }
    __threadfence();  // this block's ids, seen by the last block
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *done = 0;  // for the next launch: a graph's replay
    moe_align(starts, tile_starts, tokens_of, position, ids, tokens * top_k, top_k, experts);
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
