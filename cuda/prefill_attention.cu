// Paged prefill attention, causal, on top of a cached prefix: one kernel serves whole prompts
// and chunked prefill alike. Each sequence's new query tokens are the last query_len of its
// context_len tokens, whose K/V are already in the cache (written by write_kv), so a query at
// position p sees keys 0..p, read through the block table; with a sliding window only the last
// `window` of them (keys p - window + 1 .. p). Scores are soft-capped where softcap is not 0;
// sinks (one logit per query head, or null) join the softmax's sum and add no value.
//
// Flash-style tiles: grid (ceil(query_len * group / 16), seqs, kv_heads), 128 threads. A block
// takes 16 query rows, a row being one (token, head) pair of the KV head's group, so the rows
// of a GQA group share every K/V tile. Per tile of 32 keys, the block stages K and V in shared
// memory; each warp scores its 4 rows against the tile (a lane per key), keeps an online
// softmax per row in fp32, and accumulates the output (DIMS dims a lane, a template argument: 4
// for a head_dim of up to 128, 8 up to 256, 16 up to 512). The staged tiles are dynamic shared
// memory sized by head_dim, prefill_shared_bytes in model/ops/cuda_ops.py: (16 + 2 * 32) *
// head_dim + 32 floats, 41 KB at 128, 82 KB at 256 and 164 KB at 512 (past the 48 KB default:
// the launch raises the kernel's limit; an A100 allows 163 KB, an H100 227 KB).
//
// q, out: (tokens, heads, head_dim), the step's query tokens, sequence after sequence;
// query_starts: (seqs + 1) int32 offsets into them; context_lens: (seqs) int32;
// block_tables: (seqs, max_blocks) int32; caches: (kv_heads, blocks, block_size, head_dim).
// Limits: head_dim <= 32 * DIMS. C, the cache's element type, is T or spool_fp8_e4m3 (common.cuh's
// KvCache: rows of head_dim e4m3 values and their float32 scale): K and V are widened to float,
// times their row's scale, as they are staged.
#include "common.cuh"

#define PA_ROWS 16
#define PA_ROWS_PER_WARP 4
#define PA_KEYS 32

template <typename T, int DIMS, typename C = T>
__global__ void __launch_bounds__(128) prefill_attention(
    T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ cache_k, const C* __restrict__ cache_v,
    const int* __restrict__ query_starts, const int* __restrict__ context_lens, const int* __restrict__ block_tables,
    int heads, int kv_heads, int head_dim, int block_size, int max_blocks, int num_blocks, float scale, int window,
    float softcap, const float* __restrict__ sinks) {
    int seq = blockIdx.y, kv_head = blockIdx.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int group = heads / kv_heads;
    int first = query_starts[seq], query_len = query_starts[seq + 1] - first;
    int context = context_lens[seq], offset = context - query_len;  // position of query token 0
    int row0 = blockIdx.x * PA_ROWS;
    if (row0 >= query_len * group) return;

    SPOOL_DYNAMIC_SMEM(float, s_q);  // PA_ROWS x head_dim
    float* s_k = s_q + PA_ROWS * head_dim;  // PA_KEYS x (head_dim + 1): lanes read different rows, no bank conflicts
    float* s_v = s_k + PA_KEYS * (head_dim + 1);  // PA_KEYS x head_dim

    // Stage the block's queries (row = token * group + g), scaled.
    for (int j = threadIdx.x; j < PA_ROWS * head_dim; j += blockDim.x) {
        int r = j / head_dim, d = j % head_dim, row = row0 + r;
        float value = 0.0f;
        if (row < query_len * group) {
            int token = row / group, g = row % group;
            value = to_float(q[(size_t(first + token) * heads + kv_head * group + g) * head_dim + d]) * scale;
        }
        s_q[r * head_dim + d] = value;
    }
    int last_row = min(row0 + PA_ROWS, query_len * group) - 1;
    int keys_end = offset + last_row / group + 1;  // the block's last query sees keys < keys_end
    int keys_begin = window > 0 ? max(0, offset + row0 / group - window + 1) / PA_KEYS * PA_KEYS : 0;

    float acc[PA_ROWS_PER_WARP][DIMS], run_max[PA_ROWS_PER_WARP], run_sum[PA_ROWS_PER_WARP];
    softmax_start(acc, run_max, run_sum);

    const int* table = block_tables + size_t(seq) * max_blocks;
    size_t head_base = size_t(kv_head) * num_blocks * block_size;
    for (int tile = keys_begin; tile < keys_end; tile += PA_KEYS) {
        __syncthreads();  // the previous tile is no longer read (and s_q is staged, on the first)
        for (int j = threadIdx.x; j < PA_KEYS * head_dim; j += blockDim.x) {
            int key = j / head_dim, d = j % head_dim, pos = tile + key;
            float k = 0.0f, v = 0.0f;
            if (pos < keys_end) {
                size_t row = (head_base + size_t(table[pos / block_size]) * block_size + pos % block_size) *
                             KvCache<C>::width(head_dim);
                k = kv_value(cache_k, row, d, head_dim);
                v = kv_value(cache_v, row, d, head_dim);
            }
            s_k[key * (head_dim + 1) + d] = k;
            s_v[key * head_dim + d] = v;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < PA_ROWS_PER_WARP; ++i) {
            int r = warp * PA_ROWS_PER_WARP + i, row = row0 + r;
            if (row > last_row) break;  // warp-uniform
            int visible = offset + row / group;  // this row's query sees keys 0..visible
            int pos = tile + lane;
            float score = 0.0f;
            for (int d = 0; d < head_dim; ++d) score += s_q[r * head_dim + d] * s_k[lane * (head_dim + 1) + d];
            if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
            if (pos > visible || (window > 0 && pos <= visible - window)) score = neg_inf();
            float tile_max = warp_reduce(score, Max());
            float new_max = fmaxf(run_max[i], tile_max);
            if (new_max == neg_inf()) continue;  // no key of this tile is visible to the row yet
            float p = __expf(score - new_max), correction = __expf(run_max[i] - new_max);
            run_sum[i] = run_sum[i] * correction + warp_sum(p);
            run_max[i] = new_max;
#pragma unroll
            for (int j = 0; j < DIMS; ++j) acc[i][j] *= correction;
            for (int key = 0; key < PA_KEYS; ++key) {
                float pk = __shfl_sync(0xffffffffu, p, key);
#pragma unroll
                for (int j = 0; j < DIMS; ++j)
                    if (lane + 32 * j < head_dim) acc[i][j] += pk * s_v[key * head_dim + lane + 32 * j];
            }
        }
    }

#pragma unroll
    for (int i = 0; i < PA_ROWS_PER_WARP; ++i) {
        int row = row0 + warp * PA_ROWS_PER_WARP + i;
        if (row > last_row) break;
        int token = row / group, g = row % group;
        size_t base = (size_t(first + token) * heads + kv_head * group + g) * head_dim;
        float total = run_sum[i] + (sinks ? __expf(sinks[kv_head * group + g] - run_max[i]) : 0.0f);
#pragma unroll
        for (int j = 0; j < DIMS; ++j)
            if (lane + 32 * j < head_dim) out[base + lane + 32 * j] = from_float<T>(acc[i][j] / total);
    }
}
