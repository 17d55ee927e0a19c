// K/V write through the slot mapping: cache[h, slot, :] = k[t, h, :] (and the same for v), the
// caches laid out (kv_heads, blocks * block_size, head_dim) as model/kv_cache.py documents. A
// negative slot is padding and is skipped. One block per token.
//
// rope_write_kv: the same write from fused QKV rows (tokens, (heads + 2 kv_heads) head_dim),
// with q and k rotated on the way (rotate-half, cos/sin (tokens, head_dim / 2) fp32, as
// rotary.cu): the rotated q goes to q_out (tokens, heads, head_dim). One launch for what was two
// rotations, three copies and a write.
//
// With an fp8 cache (C = spool_fp8_e4m3, common.cuh) the caches are bytes, (kv_heads, blocks *
// block_size, head_dim + 4): K and V alike token-major, each token's and head's row its head_dim
// e4m3 values then their float32 scale s = max |x| / 448, value = e4m3(x / s) (s = 0 where the
// row is all zero: zeros stored). The value quantized is the one the storage type's cache would
// hold (k rotated and rounded to T first), so the fp8 cache is the float one's, quantized. A warp
// takes a head's row: its max, then its values. A NaN is skipped by the max and stored as NaN
// (0x7f); an infinity makes the row's scale infinite, and the row reads back as NaN.
#include "common.cuh"

// One head's row of an fp8 cache: value(d) is its element d, lane one of the warp's 32 lanes.
template <typename F>
__device__ __forceinline__ void write_fp8_row(spool_fp8_e4m3* row, int head_dim, int lane, F value) {
    float top = 0.0f;
    for (int d = lane; d < head_dim; d += 32) top = fmaxf(top, fabsf(value(d)));
    float s = warp_reduce(top, Max()) / 448.0f;
    for (int d = lane; d < head_dim; d += 32) row[d] = to_fp8_e4m3(s > 0.0f ? value(d) / s : value(d));
    if (lane == 0) *reinterpret_cast<float*>(row + head_dim) = s;
}

template <typename T, typename C = T>
__global__ void write_kv(C* __restrict__ cache_k, C* __restrict__ cache_v, const T* __restrict__ k,
                         const T* __restrict__ v, const int* __restrict__ slots, int kv_heads, int head_dim,
                         long long cache_slots) {
    long long slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = size_t(blockIdx.x) * kv_heads * head_dim;
    if constexpr (KvCache<C>::scaled) {
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, width = KvCache<C>::width(head_dim);
        for (int h = warp; h < kv_heads; h += blockDim.x >> 5) {  // warp-uniform
            size_t row = (size_t(h) * cache_slots + slot) * width, at = src + size_t(h) * head_dim;
            write_fp8_row(cache_k + row, head_dim, lane, [&](int d) { return to_float(k[at + d]); });
            write_fp8_row(cache_v + row, head_dim, lane, [&](int d) { return to_float(v[at + d]); });
        }
    } else {
        for (int j = threadIdx.x; j < kv_heads * head_dim; j += blockDim.x) {
            int h = j / head_dim, d = j % head_dim;
            size_t dst = (size_t(h) * cache_slots + slot) * head_dim + d;
            cache_k[dst] = k[src + j];
            cache_v[dst] = v[src + j];
        }
    }
}

template <typename T, typename C = T>
__global__ void rope_write_kv(T* __restrict__ q_out, C* __restrict__ cache_k, C* __restrict__ cache_v,
                              const T* __restrict__ qkv, const float* __restrict__ cos, const float* __restrict__ sin,
                              const int* __restrict__ slots, int heads, int kv_heads, int head_dim,
                              long long cache_slots) {
    int half = head_dim / 2;
    size_t t = blockIdx.x;
    const T* q = qkv + t * (heads + 2 * kv_heads) * head_dim;
    const T* k = q + size_t(heads) * head_dim;
    const T* v = k + size_t(kv_heads) * head_dim;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    T* out = q_out + t * heads * head_dim;
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        int at = j / half * head_dim + j % half, i = j % half;
        float x1 = to_float(q[at]), x2 = to_float(q[at + half]);
        out[at] = from_float<T>(x1 * c[i] - x2 * s[i]);
        out[at + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
    }
    long long slot = slots[t];
    if (slot < 0) return;  // padding: its q is computed, nothing is cached
    if constexpr (KvCache<C>::scaled) {
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, width = KvCache<C>::width(head_dim);
        for (int h = warp; h < kv_heads; h += blockDim.x >> 5) {  // warp-uniform
            size_t row = (size_t(h) * cache_slots + slot) * width;
            const T* kh = k + size_t(h) * head_dim;
            write_fp8_row(cache_k + row, head_dim, lane, [&](int d) {  // as the float cache would hold it
                int i = d % half;
                float x1 = to_float(kh[i]), x2 = to_float(kh[i + half]);
                return to_float(from_float<T>(d < half ? x1 * c[i] - x2 * s[i] : x2 * c[i] + x1 * s[i]));
            });
            write_fp8_row(cache_v + row, head_dim, lane, [&](int d) { return to_float(v[size_t(h) * head_dim + d]); });
        }
    } else {
        for (int j = threadIdx.x; j < kv_heads * half; j += blockDim.x) {
            int h = j / half, i = j % half, at = h * head_dim + i;
            size_t dst = (size_t(h) * cache_slots + slot) * head_dim + i;
            float x1 = to_float(k[at]), x2 = to_float(k[at + half]);
            cache_k[dst] = from_float<T>(x1 * c[i] - x2 * s[i]);
            cache_k[dst + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
        }
        for (int j = threadIdx.x; j < kv_heads * head_dim; j += blockDim.x) {
            int h = j / head_dim, d = j % head_dim;
            cache_v[(size_t(h) * cache_slots + slot) * head_dim + d] = v[j];
        }
    }
}
