// Paged decode attention (one query token per sequence), flash-decoding style.
//
// decode_attention: grid (kv_heads * chunks, seqs, blocks a split set), 128 threads. GROUP (a
// template argument: 1, 2, 4 or 8) query heads of one KV head a block; a larger group splits into
// chunks = ceil(group / GROUP) blocks of GROUP heads each, every one reading the KV head's rows.
// A K/V row is read by a sub-warp of LANES lanes (a template argument, so every reduction over it
// unrolls), DIMS elements a lane (a template argument too) in runs of VEC: 16 bytes a load for the
// storage types (8 elements of 16 bits, 4 of fp32), the sub-warp's runs side by side so each load
// of it is one contiguous stretch of the row; 32 / LANES rows a warp at once.
//
// A sequence's context splits into parts = min(splits, ceil(keys / min_split)) runs of whole
// pages, from its own length and the launch's constants only; block z takes parts z, z +
// gridDim.z, ..., so its result does not depend on the rest of the batch nor on the grid, and a
// graph captured for max_model_len needs only `splits` partials per head. Parts past a row's
// last write an empty partial (max -inf), which the reduce skips.
//
// In a part, warp w takes tiles w, w + 4, ... of TILE consecutive rows (ROWS a sub-warp, each row
// through its own page of the block table); the next tile's K and V are loaded into registers
// before the current tile's math. A tile's scores come first, then at most one rescale of the
// sub-warp's running (max, sum, acc) per query head for the whole tile, where the tile raises the
// max (after a context's first rows, rarely). The K and V rows are loaded once for every query
// head of the block (GQA); sub-warps then warps merge, and the block writes the part's partial
// result: the running max, the sum of exponentials, and the unnormalised output, per query head.
// decode_attention_reduce: grid (heads, seqs), merges the parts into the output, with the
// head's sink (a logit in the softmax's sum only, or null sinks) as one more part.
//
// q: (seqs, heads, head_dim); caches: (kv_heads, blocks, block_size, head_dim);
// block_tables: (seqs, max_blocks) int32; context_lens: (seqs) int32.
// Partials: max and sum (seqs, heads, splits) fp32, acc (seqs, heads, splits, head_dim) fp32.
// Limits: head_dim a multiple of VEC, at most LANES * DIMS; any group (heads a multiple of kv_heads).
//
// C, the cache's element type (common.cuh's KvCache), is T, or spool_fp8_e4m3: rows of head_dim + 4
// bytes, each row's float32 scale after its values, so rows are only 4-byte aligned and a load is
// 4 codes; a score is the row's K scale times the dot with its e4m3 values, and a row's softmax
// weight times its V scale weighs its values.
#include "common.cuh"

#define DA_WARPS 4

// VEC elements of a row, aligned as one load.
template <typename C, int VEC> struct alignas(sizeof(C) * VEC) Run {
    C v[VEC];
};

// Sum over the LANES lanes of a sub-warp (a power of two), in every lane of it.
template <int LANES> __device__ __forceinline__ float subwarp_sum(float v) {
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
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

// One tile's K and V in a lane's registers: ROWS rows, RUNS runs of each (a scaled cache's row
// scales too), and where the tile starts.
template <typename C, int ROWS, int RUNS, int VEC> struct KvTile {
    Run<C, VEC> key[ROWS][RUNS], value[ROWS][RUNS];
    float key_scale[ROWS], value_scale[ROWS];
    int start;
};

template <typename T, int GROUP, int DIMS, int LANES, typename C = T>
__global__ void __launch_bounds__(128, 4) decode_attention(  // 4 blocks an SM: at most 128 registers
    float* __restrict__ part_max, float* __restrict__ part_sum, float* __restrict__ part_acc,
    const T* __restrict__ q, const C* __restrict__ cache_k, const C* __restrict__ cache_v,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, int num_blocks, int min_split, int splits, float scale,
    int window, float softcap) {
    // a lane's elements a load: 16 bytes, or 4 codes of a scaled row (its rows are 4-byte aligned)
    constexpr int LOAD = KvCache<C>::scaled ? 4 : 16 / int(sizeof(C)), VEC = LOAD < DIMS ? LOAD : DIMS;
    constexpr int RUNS = DIMS / VEC, SUBS = 32 / LANES;
    static_assert(DIMS % VEC == 0 && (LANES == 4 || LANES == 8 || LANES == 16 || LANES == 32), "whole runs");
    // a sub-warp's rows a tile: about 32 bytes of K a lane (8 of a scaled row's codes, which
    // widen to as many floats), 16 where the group's queries and accumulators take most
    // registers; every tile is double-buffered (the prefetch)
    constexpr int ROW_BYTES = DIMS * int(sizeof(C)), FIT = KvCache<C>::scaled ? 8 : GROUP * DIMS >= 32 ? 16 : 32;
    constexpr int ROWS = FIT / ROW_BYTES >= 4 ? 4 : FIT / ROW_BYTES >= 2 ? 2 : 1;
    constexpr int TILE = SUBS * ROWS;  // a warp's rows a tile
    using Tile = KvTile<C, ROWS, RUNS, VEC>;

    int group = heads / kv_heads, chunks = (group + GROUP - 1) / GROUP, chunk = blockIdx.x % chunks;
    int kv_head = blockIdx.x / chunks, seq = blockIdx.y;
    int head0 = kv_head * group + chunk * GROUP, count = min(GROUP, group - chunk * GROUP);  // the block's heads
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LANES;
    int d0 = (lane % LANES) * VEC;  // the lane's run r starts at element d0 + r * LANES * VEC
    int context = context_lens[seq];
    int seen = window > 0 ? max(0, context - window) : 0;  // a sliding window's first key
    int base = seen / block_size * block_size;  // the parts share the pages from seen's
    int parts = min(splits, max(1, (context - seen + min_split - 1) / min_split));
    int pages = (context - base + block_size - 1) / block_size;
    int part_len = (pages + parts - 1) / parts * block_size;

    float query[GROUP][DIMS];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int r = 0; r < RUNS; ++r) {
            int d = d0 + r * LANES * VEC;
            Run<T, VEC> x = {};
            if (g < count && d < head_dim)
                x = *reinterpret_cast<const Run<T, VEC>*>(q + (size_t(seq) * heads + head0 + g) * head_dim + d);
#pragma unroll
            for (int j = 0; j < VEC; ++j) query[g][VEC * r + j] = to_float(x.v[j]) * scale;
        }

    const int* table = block_tables + size_t(seq) * max_blocks;
    size_t head_base = size_t(kv_head) * num_blocks * block_size;
    int width = KvCache<C>::width(head_dim);  // a cached row's elements: head_dim, and a scaled row's scale
    __shared__ float s_max[DA_WARPS][GROUP], s_sum[DA_WARPS][GROUP], s_acc[DA_WARPS][GROUP][LANES * DIMS];

    for (int part = blockIdx.z; part < splits; part += gridDim.z) {  // block-uniform
        int begin = max(seen, base + part * part_len), end = min(context, base + (part + 1) * part_len);
        float acc[GROUP][DIMS], run_max[GROUP], run_sum[GROUP];
        softmax_start(acc, run_max, run_sum);

        // the rows of the tile at `start` this lane reads (rows at or past `end` read as zeros)
        auto load = [&](Tile& tile, int start) {
            tile.start = start;
#pragma unroll
            for (int u = 0; u < ROWS; ++u) {
                int row = start + u * SUBS + sub;
                bool valid = row < end;
                size_t at = valid ? (head_base + size_t(table[row / block_size]) * block_size + row % block_size) * width
                                  : 0;
                if constexpr (KvCache<C>::scaled) {
                    tile.key_scale[u] = valid ? row_scale(cache_k + at, head_dim) : 0.0f;
                    tile.value_scale[u] = valid ? row_scale(cache_v + at, head_dim) : 0.0f;
                }
#pragma unroll
                for (int r = 0; r < RUNS; ++r) {
                    int d = d0 + r * LANES * VEC;
                    tile.key[u][r] = tile.value[u][r] = Run<C, VEC>{};
                    if (valid && d < head_dim) {
                        tile.key[u][r] = *reinterpret_cast<const Run<C, VEC>*>(cache_k + at + d);
                        tile.value[u][r] = *reinterpret_cast<const Run<C, VEC>*>(cache_v + at + d);
                    }
                }
            }
        };

        Tile now, next;
        load(now, begin + warp * TILE);
        for (; now.start < end; now = next) {  // warp-uniform
            load(next, now.start + DA_WARPS * TILE);  // in flight while this tile's math runs
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float score[ROWS], tile_max = neg_inf();
#pragma unroll
                for (int u = 0; u < ROWS; ++u) {
                    float dot = 0.0f;
#pragma unroll
                    for (int r = 0; r < RUNS; ++r)
#pragma unroll
                        for (int j = 0; j < VEC; ++j) dot += query[g][VEC * r + j] * to_float(now.key[u][r].v[j]);
                    score[u] = subwarp_sum<LANES>(dot);  // every lane shuffles; invalid rows are then dropped
                    if constexpr (KvCache<C>::scaled) score[u] *= now.key_scale[u];
                    if (softcap > 0.0f) score[u] = softcap * tanhf(score[u] / softcap);
                    if (now.start + u * SUBS + sub >= end) score[u] = neg_inf();
                    tile_max = fmaxf(tile_max, score[u]);
                }
                if (g >= count) continue;
                if (tile_max > run_max[g]) {  // one rescale a tile, and only where the max grows
                    float correction = __expf(run_max[g] - tile_max);
                    run_sum[g] *= correction;
#pragma unroll
                    for (int j = 0; j < DIMS; ++j) acc[g][j] *= correction;
                    run_max[g] = tile_max;
                }
                if (run_max[g] == neg_inf()) continue;  // no row of the part yet
                float weight[ROWS];
#pragma unroll
                for (int u = 0; u < ROWS; ++u) {
                    weight[u] = __expf(score[u] - run_max[g]);
                    run_sum[g] += weight[u];
                    if constexpr (KvCache<C>::scaled) weight[u] *= now.value_scale[u];  // the values' share
                }
#pragma unroll
                for (int r = 0; r < RUNS; ++r)
#pragma unroll
                    for (int j = 0; j < VEC; ++j)
#pragma unroll
                        for (int u = 0; u < ROWS; ++u)
                            acc[g][VEC * r + j] += weight[u] * to_float(now.value[u][r].v[j]);
            }
        }

        // Merge the sub-warps of each warp (lanes that hold the same elements), then the warps.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int offset = LANES; offset < 32; offset <<= 1) {
                float other[DIMS];
#pragma unroll
                for (int j = 0; j < DIMS; ++j) other[j] = __shfl_xor_sync(0xffffffffu, acc[g][j], offset);
                float m2 = __shfl_xor_sync(0xffffffffu, run_max[g], offset);
                float sum2 = __shfl_xor_sync(0xffffffffu, run_sum[g], offset);
                merge<DIMS>(run_max[g], run_sum[g], acc[g], m2, sum2, other);
            }
            if (lane == 0) {
                s_max[warp][g] = run_max[g];
                s_sum[warp][g] = run_sum[g];
            }
#pragma unroll
            for (int r = 0; r < RUNS; ++r) {
                int d = d0 + r * LANES * VEC;
                if (sub == 0 && d < head_dim) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) s_acc[warp][g][d + j] = acc[g][VEC * r + j];
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
                    int d = d0 + j / VEC * LANES * VEC + j % VEC;
                    out[j] = d < head_dim ? s_acc[0][g][d] : 0.0f;
                }
#pragma unroll
                for (int w = 1; w < DA_WARPS; ++w) {
                    float other[DIMS];
#pragma unroll
                    for (int j = 0; j < DIMS; ++j) {
                        int d = d0 + j / VEC * LANES * VEC + j % VEC;
                        other[j] = d < head_dim ? s_acc[w][g][d] : 0.0f;
                    }
                    merge<DIMS>(m, total, out, s_max[w][g], s_sum[w][g], other);
                }
                size_t at = (size_t(seq) * heads + head0 + g) * splits + part;
                if (lane == 0) {
                    part_max[at] = m;
                    part_sum[at] = total;
                }
#pragma unroll
                for (int j = 0; j < DIMS; ++j) {
                    int d = d0 + j / VEC * LANES * VEC + j % VEC;
                    if (d < head_dim) part_acc[at * head_dim + d] = out[j];
                }
            }
        }
        __syncthreads();  // the shared partials are the next part's
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
