// Paged decode attention (one query token per sequence), flash-decoding style.
//
// decode_attention: grid (kv_heads, seqs, splits), 128 threads. A block takes one KV head of one
// sequence over one split of its context; its four warps walk the split's tokens in turn. A
// sequence's context splits into min(splits, ceil(context / min_split)) parts of whole pages,
// from its own length only: its result does not depend on the rest of the batch, and a graph
// captured for max_model_len needs only `splits` partials per head. Splits past the last part
// write an empty partial (max -inf), which the reduce skips. For
// each token, a warp loads the K and V rows once (each lane holds head_dim / 32 elements) and
// uses them for every query head of the group (GQA), with an online softmax per query in fp32.
// The warps then merge, and the block writes its partial result: the running max, the sum of
// exponentials, and the unnormalised output, per query head.
// decode_attention_reduce: grid (heads, seqs), merges the splits into the output.
//
// q: (seqs, heads, head_dim); caches: (kv_heads, blocks, block_size, head_dim);
// block_tables: (seqs, max_blocks) int32; context_lens: (seqs) int32.
// Partials: max and sum (seqs, heads, splits) fp32, acc (seqs, heads, splits, head_dim) fp32.
// Limits: head_dim <= 128 (4 elements a lane), group = heads / kv_heads <= 8.
#include "common.cuh"

#define DA_WARPS 4
#define DA_DIMS 4
#define DA_GROUP 8

template <typename T>
__global__ void __launch_bounds__(128) decode_attention(
    float* __restrict__ part_max, float* __restrict__ part_sum, float* __restrict__ part_acc,
    const T* __restrict__ q, const T* __restrict__ cache_k, const T* __restrict__ cache_v,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, int num_blocks, int min_split, float scale) {
    int kv_head = blockIdx.x, seq = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int group = heads / kv_heads;
    int context = context_lens[seq];
    int parts = min(splits, max(1, (context + min_split - 1) / min_split));
    int pages = (context + block_size - 1) / block_size;
    int split_len = (pages + parts - 1) / parts * block_size;
    int begin = split * split_len, end = min(context, begin + split_len);

    float query[DA_GROUP][DA_DIMS], acc[DA_GROUP][DA_DIMS], run_max[DA_GROUP], run_sum[DA_GROUP];
#pragma unroll
    for (int g = 0; g < DA_GROUP; ++g) {
        run_max[g] = neg_inf();
        run_sum[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < DA_DIMS; ++j) {
            int d = lane + 32 * j;
            bool live = g < group && d < head_dim;
            query[g][j] = live ? to_float(q[(size_t(seq) * heads + kv_head * group + g) * head_dim + d]) * scale : 0.0f;
            acc[g][j] = 0.0f;
        }
    }

    const int* table = block_tables + size_t(seq) * max_blocks;
    size_t head_base = size_t(kv_head) * num_blocks * block_size;
    for (int t = begin + warp; t < end; t += DA_WARPS) {
        size_t row = (head_base + size_t(table[t / block_size]) * block_size + t % block_size) * head_dim;
        float key[DA_DIMS], value[DA_DIMS];
#pragma unroll
        for (int j = 0; j < DA_DIMS; ++j) {
            int d = lane + 32 * j;
            key[j] = d < head_dim ? to_float(cache_k[row + d]) : 0.0f;
            value[j] = d < head_dim ? to_float(cache_v[row + d]) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < DA_GROUP; ++g) {
            if (g >= group) break;
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < DA_DIMS; ++j) dot += query[g][j] * key[j];
            float score = warp_sum(dot);
            float new_max = fmaxf(run_max[g], score);
            float correction = __expf(run_max[g] - new_max), weight = __expf(score - new_max);
            run_sum[g] = run_sum[g] * correction + weight;
#pragma unroll
            for (int j = 0; j < DA_DIMS; ++j) acc[g][j] = acc[g][j] * correction + weight * value[j];
            run_max[g] = new_max;
        }
    }

    // Merge the warps: each writes its state to shared memory, warp 0 combines.
    __shared__ float s_max[DA_WARPS][DA_GROUP], s_sum[DA_WARPS][DA_GROUP], s_acc[DA_WARPS][DA_GROUP][DA_DIMS * 32];
#pragma unroll
    for (int g = 0; g < DA_GROUP; ++g) {
        if (lane == 0) {
            s_max[warp][g] = run_max[g];
            s_sum[warp][g] = run_sum[g];
        }
#pragma unroll
        for (int j = 0; j < DA_DIMS; ++j) s_acc[warp][g][lane + 32 * j] = acc[g][j];
    }
    __syncthreads();
    if (warp == 0) {
        for (int g = 0; g < group; ++g) {
            float m = neg_inf();
            for (int w = 0; w < DA_WARPS; ++w) m = fmaxf(m, s_max[w][g]);
            float total = 0.0f, out[DA_DIMS] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int w = 0; w < DA_WARPS; ++w) {
                float f = s_max[w][g] == neg_inf() ? 0.0f : __expf(s_max[w][g] - m);
                total += s_sum[w][g] * f;
#pragma unroll
                for (int j = 0; j < DA_DIMS; ++j) out[j] += s_acc[w][g][lane + 32 * j] * f;
            }
            size_t at = (size_t(seq) * heads + kv_head * group + g) * splits + split;
            if (lane == 0) {
                part_max[at] = m;
                part_sum[at] = total;
            }
#pragma unroll
            for (int j = 0; j < DA_DIMS; ++j)
                if (lane + 32 * j < head_dim) part_acc[at * head_dim + lane + 32 * j] = out[j];
        }
    }
}

template <typename T>
__global__ void decode_attention_reduce(T* __restrict__ out, const float* __restrict__ part_max,
                                        const float* __restrict__ part_sum, const float* __restrict__ part_acc,
                                        int heads, int head_dim, int splits) {
    size_t at = (size_t(blockIdx.y) * heads + blockIdx.x) * splits;
    float m = neg_inf();
    for (int s = 0; s < splits; ++s) m = fmaxf(m, part_max[at + s]);
    float total = 0.0f;
    for (int s = 0; s < splits; ++s)
        if (part_max[at + s] != neg_inf()) total += part_sum[at + s] * __expf(part_max[at + s] - m);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
        for (int s = 0; s < splits; ++s)
            if (part_max[at + s] != neg_inf()) value += part_acc[(at + s) * head_dim + d] * __expf(part_max[at + s] - m);
        out[(size_t(blockIdx.y) * heads + blockIdx.x) * head_dim + d] = from_float<T>(value / total);
    }
}
