// K/V write through the slot mapping: cache[h, slot, :] = k[t, h, :] (and the same for v), the
// caches laid out (kv_heads, blocks * block_size, head_dim) as model/kv_cache.py documents. A
// negative slot is padding and is skipped. One block per token.
//
// rope_write_kv: the same write from fused QKV rows (tokens, (heads + 2 kv_heads) head_dim),
// with q and k rotated on the way (rotate-half, cos/sin (tokens, head_dim / 2) fp32, as
// rotary.cu): the rotated q goes to q_out (tokens, heads, head_dim). One launch for what was two
// rotations, three copies and a write.
#include "common.cuh"

template <typename T>
__global__ void write_kv(T* __restrict__ cache_k, T* __restrict__ cache_v, const T* __restrict__ k,
                         const T* __restrict__ v, const int* __restrict__ slots, int kv_heads, int head_dim,
                         long long cache_slots) {
    long long slot = slots[blockIdx.x];
    if (slot < 0) return;
    size_t src = size_t(blockIdx.x) * kv_heads * head_dim;
    for (int j = threadIdx.x; j < kv_heads * head_dim; j += blockDim.x) {
        int h = j / head_dim, d = j % head_dim;
        size_t dst = (size_t(h) * cache_slots + slot) * head_dim + d;
        cache_k[dst] = k[src + j];
        cache_v[dst] = v[src + j];
    }
}

template <typename T>
__global__ void rope_write_kv(T* __restrict__ q_out, T* __restrict__ cache_k, T* __restrict__ cache_v,
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
