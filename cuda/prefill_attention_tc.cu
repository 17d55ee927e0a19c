// Paged prefill attention on tensor cores (WMMA, 16 x 16 x 16 tiles, fp32 accumulation), for
// fp16 and bf16 and a head_dim that is a multiple of 16 (at most 512); prefill_attention.cu's
// CUDA-core kernel serves the rest. The same contract: causal, on top of a cached prefix, a
// query at position p sees keys 0..p through the block table, rows being (token, head) pairs of
// one KV head's group so a GQA group shares every K/V tile; a sliding window and soft-capped
// scores as there.
//
// Grid (ceil(query_len * group / 64), seqs, kv_heads), 128 threads: each warp takes 16 query
// rows, the block 64, and the block stages 32 keys of K and V at a time in shared memory.
// Passes over the keys, so that no accumulator fragment is ever rescaled (a fragment's layout
// across the lanes is not CUDA's to rely on): the first finds each row's softmax max and sum
// from S = Q K^T; each later one recomputes S and adds P V for 128 dims of the output (8
// accumulator tiles in registers: one value pass up to a head_dim of 128, two up to 256, four
// up to 512), with
// P = exp(S - max) / sum rounded to the storage type as the tensor cores take it. The output
// goes out through shared memory, a 16 x 16 tile at a time, after each value pass.
//
// The queries and the key tile, full head_dim rows, are dynamic shared memory:
// (64 + 32) * (head_dim + 8) elements, prefill_shared_bytes in model/ops/cuda_ops.py; with the
// static rest, 46 KB at a head_dim of 128, 70 KB at 256 and 118 KB at 512 (past the 48 KB
// default: the launch raises the kernel's limit).
//
// q, out: (tokens, heads, head_dim); query_starts: (seqs + 1) int32; context_lens: (seqs) int32;
// block_tables: (seqs, max_blocks) int32; caches: (kv_heads, blocks, block_size, head_dim).
// C, the cache's element type, is T or spool_fp8_e4m3 (common.cuh's KvCache): an fp8 cache's K and
// V are widened to float times their row's scale as they are staged, and rounded to T there, as the
// tensor cores take them.
// <mma.h> includes crt/mma.h: a CUDA toolkit's headers have it, the pip CUDA runtime wheel's do
// not (then CudaOps falls back to prefill_attention.cu). NVRTC 13.5 compiles this file with a
// toolkit's include directory.
#include <mma.h>

#include "common.cuh"

#define TC_WARPS 4
#define TC_ROWS 16  // query rows a warp takes: one tile
#define TC_KEYS 32  // keys a block stages at once: two tiles
#define TC_TILES 8  // output tiles of 16 dims a value pass
#define TC_V_STRIDE (16 * TC_TILES + 8)  // shared rows padded by 8: tiles stay 32-byte aligned, banks spread

using namespace nvcuda;

template <typename T>
using TileA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// The warp's 16 x 32 scores, S = Q K^T over head_dim, into scores (row-major, TC_KEYS a row);
// queries and keys are rows of `stride` elements.
template <typename T>
__device__ __forceinline__ void score_tile(float* scores, const T* queries, const T* keys, int tiles, int stride) {
    Accumulator s[2];
    wmma::fill_fragment(s[0], 0.0f);
    wmma::fill_fragment(s[1], 0.0f);
    for (int d = 0; d < tiles; ++d) {
        TileA<T> a;
        wmma::load_matrix_sync(a, queries + 16 * d, stride);
#pragma unroll
        for (int n = 0; n < 2; ++n) {  // K as stored (key-major) is K^T column-major
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
            wmma::load_matrix_sync(b, keys + 16 * n * stride + 16 * d, stride);
            wmma::mma_sync(s[n], a, b, s[n]);
        }
    }
    wmma::store_matrix_sync(scores, s[0], TC_KEYS, wmma::mem_row_major);
    wmma::store_matrix_sync(scores + 16, s[1], TC_KEYS, wmma::mem_row_major);
}

// Where key pos's row starts in a cache of the KV head at head_base, through the block table;
// width: a cached row's elements (KvCache).
__device__ __forceinline__ size_t key_row(const int* table, size_t head_base, int pos, int block_size, int width) {
    return (head_base + size_t(table[pos / block_size]) * block_size + pos % block_size) * width;
}

// Element d of a cached row as T: itself, or an fp8 row's value times its scale, rounded.
template <typename T, typename C> __device__ __forceinline__ T staged(const C* cache, size_t row, int d, int head_dim) {
    if constexpr (KvCache<C>::scaled) return from_float<T>(kv_value(cache, row, d, head_dim));
    else return cache[row + d];
}

template <typename T, typename C = T>
__global__ void __launch_bounds__(128) prefill_attention_tc(
    T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ cache_k, const C* __restrict__ cache_v,
    const int* __restrict__ query_starts, const int* __restrict__ context_lens, const int* __restrict__ block_tables,
    int heads, int kv_heads, int head_dim, int block_size, int max_blocks, int num_blocks, float scale, int window,
    float softcap, const float* __restrict__ sinks) {
    int seq = blockIdx.y, kv_head = blockIdx.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int group = heads / kv_heads, tiles = head_dim / 16;
    int first = query_starts[seq], query_len = query_starts[seq + 1] - first;
    int context = context_lens[seq], offset = context - query_len;  // position of query token 0
    int rows = query_len * group, row0 = blockIdx.x * TC_WARPS * TC_ROWS;
    if (row0 >= rows) return;

    int stride = head_dim + 8;  // shared rows of the queries and keys, padded as TC_V_STRIDE
    SPOOL_DYNAMIC_SMEM(T, s_q);  // TC_WARPS * TC_ROWS rows, then the key tile's TC_KEYS
    T* s_k = s_q + TC_WARPS * TC_ROWS * stride;
    __shared__ __align__(32) T s_v[TC_KEYS][TC_V_STRIDE];  // a value pass's 128 dims of the key tile
    __shared__ __align__(32) float s_s[TC_WARPS][TC_ROWS][TC_KEYS];  // scores; then output tiles
    __shared__ __align__(32) T s_p[TC_WARPS][TC_ROWS][TC_KEYS];

    for (int j = threadIdx.x; j < TC_WARPS * TC_ROWS * head_dim; j += blockDim.x) {  // the queries, scaled
        int r = j / head_dim, d = j % head_dim, row = row0 + r;
        float value = 0.0f;
        if (row < rows)
            value = to_float(q[(size_t(first + row / group) * heads + kv_head * group + row % group) * head_dim + d]) * scale;
        s_q[r * stride + d] = from_float<T>(value);
    }
    int keys_end = offset + (min(row0 + TC_WARPS * TC_ROWS, rows) - 1) / group + 1;  // the last row's keys
    int keys_begin = window > 0 ? max(0, offset + row0 / group - window + 1) / TC_KEYS * TC_KEYS : 0;

    // Each lane owns half of one row of the warp's scores: row lane / 2, keys 16 (lane % 2) onwards.
    int my_row = warp * TC_ROWS + lane / 2, half = 16 * (lane % 2);
    int visible = offset + (row0 + my_row) / group;  // the row's query sees keys 0..visible
    const int* table = block_tables + size_t(seq) * max_blocks;
    size_t head_base = size_t(kv_head) * num_blocks * block_size;
    int width = KvCache<C>::width(head_dim);
    float* scores = &s_s[warp][0][0];
    float row_max = neg_inf(), row_sum = 0.0f;
    Accumulator acc[TC_TILES];
#pragma unroll
    for (int t = 0; t < TC_TILES; ++t) wmma::fill_fragment(acc[t], 0.0f);

    int value_passes = (tiles + TC_TILES - 1) / TC_TILES;
    for (int pass = 0; pass <= value_passes; ++pass) {
        int dim0 = 16 * TC_TILES * (pass - 1), out_tiles = min(TC_TILES, tiles - TC_TILES * (pass - 1));  // values'
        for (int tile = keys_begin; tile < keys_end; tile += TC_KEYS) {
            __syncthreads();  // the last tile is read (and the queries staged, the first time)
            for (int j = threadIdx.x; j < TC_KEYS * head_dim; j += blockDim.x) {
                int key = j / head_dim, d = j % head_dim, pos = tile + key;
                s_k[key * stride + d] = pos < keys_end ? staged<T>(cache_k, key_row(table, head_base, pos, block_size, width), d,
                                                                  head_dim)
                                                       : from_float<T>(0.0f);
            }
            for (int j = threadIdx.x; pass && j < TC_KEYS * 16 * out_tiles; j += blockDim.x) {
                int key = j / (16 * out_tiles), d = j % (16 * out_tiles), pos = tile + key;
                s_v[key][d] = pos < keys_end ? staged<T>(cache_v, key_row(table, head_base, pos, block_size, width),
                                                         dim0 + d, head_dim)
                                             : from_float<T>(0.0f);
            }
            __syncthreads();
            score_tile(scores, &s_q[warp * TC_ROWS * stride], s_k, tiles, stride);
            __syncwarp();
            for (int c = 0; c < 16; ++c) {
                int pos = tile + half + c;
                bool seen = pos <= visible && pos < keys_end && (window <= 0 || pos > visible - window);
                float s = scores[(lane / 2) * TC_KEYS + half + c];
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                if (pass == 0) {
                    if (!seen) continue;
                    float top = fmaxf(row_max, s);
                    row_sum = row_sum * __expf(row_max - top) + __expf(s - top);
                    row_max = top;
                } else {
                    float p = seen && row_sum > 0.0f ? __expf(s - row_max) / row_sum : 0.0f;
                    s_p[warp][lane / 2][half + c] = from_float<T>(p);
                }
            }
            if (pass == 0) continue;
            __syncwarp();
#pragma unroll
            for (int k = 0; k < 2; ++k) {  // O += P V, 16 keys at a time
                TileA<T> p;
                wmma::load_matrix_sync(p, &s_p[warp][0][16 * k], TC_KEYS);
#pragma unroll
                for (int t = 0; t < TC_TILES; ++t) {
                    if (t >= out_tiles) break;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v;
                    wmma::load_matrix_sync(v, &s_v[16 * k][16 * t], TC_V_STRIDE);
                    wmma::mma_sync(acc[t], p, v, acc[t]);
                }
            }
        }
        if (pass == 0) {  // the two halves of each row merge
            float other_max = __shfl_xor_sync(0xffffffffu, row_max, 1);
            float other_sum = __shfl_xor_sync(0xffffffffu, row_sum, 1);
            float top = fmaxf(row_max, other_max);
            row_sum = (row_max == neg_inf() ? 0.0f : row_sum * __expf(row_max - top)) +
                      (other_max == neg_inf() ? 0.0f : other_sum * __expf(other_max - top));
            row_max = top;
            if (sinks) {  // the head's sink: a share of the sum, no value
                float sink = sinks[kv_head * group + (row0 + my_row) % group];
                top = fmaxf(row_max, sink);
                row_sum = (row_max == neg_inf() ? 0.0f : row_sum * __expf(row_max - top)) + __expf(sink - top);
                row_max = top;
            }
            continue;
        }
        __syncwarp();
#pragma unroll
        for (int t = 0; t < TC_TILES; ++t) {  // out, a 16 x 16 tile at a time through the scores' space
            if (t >= out_tiles) break;
            wmma::store_matrix_sync(scores, acc[t], TC_KEYS, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 16 * 16; e += 32) {
                int r = e / 16, d = dim0 + 16 * t + e % 16, row = row0 + warp * TC_ROWS + r;
                if (row < rows)
                    out[(size_t(first + row / group) * heads + kv_head * group + row % group) * head_dim + d] =
                        from_float<T>(scores[r * TC_KEYS + e % 16]);
            }
            __syncwarp();
            wmma::fill_fragment(acc[t], 0.0f);  // for the next value pass
        }
    }
}
