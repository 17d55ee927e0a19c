// K/V write through the slot mapping: cache[h, slot, :] = k[t, h, :] (and the same for v), the
// caches laid out (kv_heads, blocks * block_size, head_dim) as model/kv_cache.py documents. A
// negative slot is padding and is skipped. One block per token.
#include "common.cuh"

template <typename T>
__global__ void write_kv(T* __restrict__ cache_k, T* __restrict__ cache_v, const T* __restrict__ k,
                         const T* __restrict__ v, const long long* __restrict__ slots, int kv_heads, int head_dim,
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
