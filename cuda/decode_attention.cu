// Paged decode attention (one query token per sequence), flash-decoding style.
//
// decode_attention: grid (kv_heads * chunks, seqs, splits), 128 threads. GROUP (a template
// argument: 1, 2, 4 or 8) query heads of one KV head a block; a larger group splits into chunks
// = ceil(group / GROUP) blocks of GROUP heads each, every one reading the KV head's rows (a
// group of 16 or more needs no more registers, only more reads of K and V, mostly from L2).
// DIMS (4, 8 or 16, a template argument too) elements of a row a lane: 4 serve a head_dim of up
// to 128, 8 up to 256, 16 up to 512 (Gemma 4's full layers). A block takes one chunk of one KV head of one sequence over one split of its
// context. A sequence's context splits into min(splits, ceil(context / min_split)) parts of
// whole pages, from its own length only: its result does not depend on the rest of the batch,
// and a graph captured for max_model_len needs only `splits` partials per head. Splits past the
// last part write an empty partial (max -inf), which the reduce skips.
//
// Each warp takes whole pages (one block-table load per page) and splits into sub-warps of the
// fewest lanes whose DIMS elements each cover head_dim (16 lanes for 64, 32 for 128 to 512):
// a lane's elements are DIMS / 4 runs of 4 (a Four: one 8-byte load for the 16-bit types,
// 16-byte for fp32), the sub-warp's runs side by side, so each load of the sub-warp is one
// contiguous stretch of the row. Each sub-warp has up to DA_UNROLL rows in flight (fewer where
// a lane holds more: fp32, DIMS 8, the larger groups). The K and V rows are loaded once and used
// for every query head of the chunk (GQA), with an online softmax per sub-warp and query in
// fp32; sub-warps then warps merge, and the block writes its partial result: the running max,
// the sum of exponentials, and the unnormalised output, per query head.
// decode_attention_reduce: grid (heads, seqs), merges the splits into the output, with the
// head's sink (a logit in the softmax's sum only, or null sinks) as one more part.
//
// q: (seqs, heads, head_dim); caches: (kv_heads, blocks, block_size, head_dim);
// block_tables: (seqs, max_blocks) int32; context_lens: (seqs) int32.
// Partials: max and sum (seqs, heads, splits) fp32, acc (seqs, heads, splits, head_dim) fp32.
// Limits: head_dim a multiple of 4, at most 32 * DIMS; any group (heads a multiple of kv_heads).
//
// C, the cache's element type (common.cuh's KvCache), is T, or spool_fp8_e4m3: rows of head_dim + 4
// bytes, each row's float32 scale after its values; a lane loads a Four of bytes and each row's
// two scales, and a score is the row's K scale times the dot with its e4m3 values, a row's
// softmax weight times its V scale weighs its values (the same rows in flight as T's).
#include "common.cuh"

#define DA_WARPS 4
#define DA_UNROLL 4  // rows in flight per sub-warp for 16-bit types at 4 elements a lane

// Sum over the `lanes` lanes of a sub-warp (a power of two), in every lane of it.
__device__ __forceinline__ float subwarp_sum(float v, int lanes) {
    for (int offset = lanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// (max, sum, acc) of one softmax merged with another's: each part scaled to the common max.
template <int DIMS>
__device__ __forceinline__ void merge(float& m, float& sum, float* acc, float m2, float sum2, const float* acc2) {
    float top = fmaxf(m, m2);
    float f = m == neg_inf() ? 0.0f : __expf(m - top), f2 = m2 == neg_inf() ? 0.0f : __expf(m2 - top);
    sum = sum * f + sum2 * f2;
#pragma unroll
    for (int j = 0; j < DIMS; ++j) acc[j] = acc[j] * f + acc2[j] * f2;
    m = top;
}

template <typename T, int GROUP, int DIMS, typename C = T>
__global__ void __launch_bounds__(128, 4) decode_attention(  // 4 blocks an SM: at most 128 registers
    float* __restrict__ part_max, float* __restrict__ part_sum, float* __restrict__ part_acc,
    const T* __restrict__ q, const C* __restrict__ cache_k, const C* __restrict__ cache_v,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, int num_blocks, int min_split, float scale, int window,
    float softcap) {
    static_assert(DIMS == 4 || DIMS == 8 || DIMS == 16, "a lane holds one, two or four Fours of a row");
    constexpr int RUNS = DIMS / 4;  // a lane's Fours of a row
    int group = heads / kv_heads, chunks = (group + GROUP - 1) / GROUP, chunk = blockIdx.x % chunks;
    int kv_head = blockIdx.x / chunks, seq = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    int head0 = kv_head * group + chunk * GROUP, count = min(GROUP, group - chunk * GROUP);  // the block's heads
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int lanes = 32;  // a sub-warp: the fewest lanes (a power of two) that cover head_dim
    while (lanes > 1 && (lanes / 2) * DIMS >= head_dim) lanes /= 2;
    int sub = lane / lanes, subs = 32 / lanes;
    int d0 = (lane % lanes) * 4, stride = lanes * 4;  // the lane's run r starts at element d0 + r * stride
    int context = context_lens[seq];
    int seen = window > 0 ? max(0, context - window) : 0;  // a sliding window's first key
    int base = seen / block_size * block_size;  // the splits share the pages from seen's
    int parts = min(splits, max(1, (context - seen + min_split - 1) / min_split));
    int pages = (context - base + block_size - 1) / block_size;
    int split_len = (pages + parts - 1) / parts * block_size;
    int begin = max(seen, base + split * split_len), end = min(context, base + (split + 1) * split_len);

    float query[GROUP][DIMS], acc[GROUP][DIMS], run_max[GROUP], run_sum[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        run_max[g] = neg_inf();
        run_sum[g] = 0.0f;
#pragma unroll
        for (int r = 0; r < RUNS; ++r) {
            int d = d0 + r * stride;
            Four<T> x = {};
            if (g < count && d < head_dim)
                x = *reinterpret_cast<const Four<T>*>(q + (size_t(seq) * heads + head0 + g) * head_dim + d);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                query[g][4 * r + j] = to_float(x.v[j]) * scale;
                acc[g][4 * r + j] = 0.0f;
            }
        }
    }

    // the same bytes in flight whatever a row's load (fewer rows for fp32 and DIMS 8); one row
    // where the group's queries and accumulators take most registers
    constexpr int unroll = GROUP * DIMS >= 32 || DIMS * sizeof(T) >= 32 ? 1 : DA_UNROLL * 8 / int(DIMS * sizeof(T));
    const int* table = block_tables + size_t(seq) * max_blocks;
    size_t head_base = size_t(kv_head) * num_blocks * block_size;
    int width = KvCache<C>::width(head_dim);  // a cached row's elements: head_dim, and a scaled row's scale
    int first_page = begin / block_size, last_page = (end + block_size - 1) / block_size;
    for (int page = first_page + warp; page < last_page; page += DA_WARPS) {  // warp-uniform
        size_t page_base = (head_base + size_t(table[page]) * block_size) * width;
        int page_start = page * block_size;
        for (int i0 = 0; i0 < block_size; i0 += subs * unroll) {
            Four<C> key[unroll][RUNS], value[unroll][RUNS];
            float key_scale[unroll], value_scale[unroll];  // a scaled row's; unused otherwise
            bool valid[unroll];
#pragma unroll
            for (int u = 0; u < unroll; ++u) {  // every load first: unroll rows in flight
                int i = i0 + u * subs + sub;
                valid[u] = i < block_size && page_start + i >= begin && page_start + i < end;
                if constexpr (KvCache<C>::scaled) {
                    key_scale[u] = valid[u] ? row_scale(cache_k + page_base + size_t(i) * width, head_dim) : 0.0f;
                    value_scale[u] = valid[u] ? row_scale(cache_v + page_base + size_t(i) * width, head_dim) : 0.0f;
                }
#pragma unroll
                for (int r = 0; r < RUNS; ++r) {
                    int d = d0 + r * stride;
                    key[u][r] = value[u][r] = Four<C>{};
                    if (valid[u] && d < head_dim) {
                        key[u][r] = *reinterpret_cast<const Four<C>*>(cache_k + page_base + size_t(i) * width + d);
                        value[u][r] = *reinterpret_cast<const Four<C>*>(cache_v + page_base + size_t(i) * width + d);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < unroll; ++u) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float dot = 0.0f;
#pragma unroll
                    for (int r = 0; r < RUNS; ++r)
#pragma unroll
                        for (int j = 0; j < 4; ++j) dot += query[g][4 * r + j] * to_float(key[u][r].v[j]);
                    float score = subwarp_sum(dot, lanes);  // every lane shuffles; invalid rows are then skipped
                    if (!valid[u] || g >= count) continue;
                    if constexpr (KvCache<C>::scaled) score *= key_scale[u];
                    if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
                    float new_max = fmaxf(run_max[g], score);
                    float correction = __expf(run_max[g] - new_max), weight = __expf(score - new_max);
                    run_sum[g] = run_sum[g] * correction + weight;
                    if constexpr (KvCache<C>::scaled) weight *= value_scale[u];  // the values' share
#pragma unroll
                    for (int r = 0; r < RUNS; ++r)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            acc[g][4 * r + j] = acc[g][4 * r + j] * correction + weight * to_float(value[u][r].v[j]);
                    run_max[g] = new_max;
                }
            }
        }
    }

    // Merge the sub-warps of each warp (lanes that hold the same elements), then the warps.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {  // unrolled: no local arrays
            if (offset < lanes) continue;
            float other[DIMS];
#pragma unroll
            for (int j = 0; j < DIMS; ++j) other[j] = __shfl_xor_sync(0xffffffffu, acc[g][j], offset);
            float m2 = __shfl_xor_sync(0xffffffffu, run_max[g], offset);
            float sum2 = __shfl_xor_sync(0xffffffffu, run_sum[g], offset);
            merge<DIMS>(run_max[g], run_sum[g], acc[g], m2, sum2, other);
        }
    }
    __shared__ float s_max[DA_WARPS][GROUP], s_sum[DA_WARPS][GROUP], s_acc[DA_WARPS][GROUP][32 * DIMS];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        if (lane == 0) {
            s_max[warp][g] = run_max[g];
            s_sum[warp][g] = run_sum[g];
        }
#pragma unroll
        for (int r = 0; r < RUNS; ++r) {
            int d = d0 + r * stride;
            if (sub == 0 && d < head_dim) {
#pragma unroll
                for (int j = 0; j < 4; ++j) s_acc[warp][g][d + j] = acc[g][4 * r + j];
            }
        }
    }
    __syncthreads();
    if (warp == 0 && sub == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (g >= count) break;
            float m = s_max[0][g], total = s_sum[0][g], out[DIMS];
#pragma unroll
            for (int j = 0; j < DIMS; ++j) {
                int d = d0 + j / 4 * stride + j % 4;
                out[j] = d < head_dim ? s_acc[0][g][d] : 0.0f;
            }
#pragma unroll
            for (int w = 1; w < DA_WARPS; ++w) {
                float other[DIMS];
#pragma unroll
                for (int j = 0; j < DIMS; ++j) {
                    int d = d0 + j / 4 * stride + j % 4;
                    other[j] = d < head_dim ? s_acc[w][g][d] : 0.0f;
                }
                merge<DIMS>(m, total, out, s_max[w][g], s_sum[w][g], other);
            }
            size_t at = (size_t(seq) * heads + head0 + g) * splits + split;
            if (lane == 0) {
                part_max[at] = m;
                part_sum[at] = total;
            }
#pragma unroll
            for (int j = 0; j < DIMS; ++j) {
                int d = d0 + j / 4 * stride + j % 4;
                if (d < head_dim) part_acc[at * head_dim + d] = out[j];
            }
        }
    }
}

template <typename T>
__global__ void decode_attention_reduce(T* __restrict__ out, const float* __restrict__ part_max,
                                        const float* __restrict__ part_sum, const float* __restrict__ part_acc,
                                        int heads, int head_dim, int splits, const float* __restrict__ sinks) {
    size_t at = (size_t(blockIdx.y) * heads + blockIdx.x) * splits;
    float m = sinks ? sinks[blockIdx.x] : neg_inf();
    for (int s = 0; s < splits; ++s) m = fmaxf(m, part_max[at + s]);
    float total = sinks ? __expf(sinks[blockIdx.x] - m) : 0.0f;
    for (int s = 0; s < splits; ++s)
        if (part_max[at + s] != neg_inf()) total += part_sum[at + s] * __expf(part_max[at + s] - m);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
        for (int s = 0; s < splits; ++s)
            if (part_max[at + s] != neg_inf()) value += part_acc[(at + s) * head_dim + d] * __expf(part_max[at + s] - m);
        out[(size_t(blockIdx.y) * heads + blockIdx.x) * head_dim + d] = from_float<T>(value / total);
    }
}
