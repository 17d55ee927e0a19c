// K/V write through the slot mapping: cache[h, slot, :] = k[t, h, :] (and the same for v), the
// caches laid out (kv_heads, blocks * block_size, head_dim) as model/kv_cache.py documents. A
// negative slot is padding and is skipped. One block per token.
//
// rope_write_kv: the same write from fused QKV rows (tokens, width): q (heads x head_dim) first,
// k and v (kv_heads x head_dim each) last, anything between (a gated attention's gate) left
// alone; q and k rotated on the way (rotate-half, cos/sin (tokens, head_dim / 2) fp32, as
// rotary.cu): the rotated q goes to q_out (tokens, heads, head_dim). One launch for what was two
// rotations, three copies and a write. With q/k norms (q_norm and k_norm, null for none) q and k
// are RMS-normalised first, over each head or (norm_whole, OLMoE's) over the whole projection,
// and v over each head where v_norm is given (Gemma 4's): each normalised value rounded to T as
// rms_norm writes it, its sum of squares taken in rms_norm's order at 128 threads, so launched
// with 128 threads the bits are those of rms_norm, then rotary (the norms, rotations, copies and
// write were eleven launches and more). A warp a head.
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

// A head's sum of squares, bit for bit what rms_norm sums for a row of head_dim at 128 threads:
// its units (fours where head_dim is a multiple of 4, else elements) u = 32 c + l + 128 m summed
// by lane l for each c as that kernel's thread 32 c + l sums them, and the four warp sums added
// as block_sum adds warps' ((c0 + c2) + (c1 + c3)).
template <typename T>
__device__ __forceinline__ float head_squares(const T* row, int head_dim, int lane) {
    int width = head_dim % 4 ? 1 : 4, units = head_dim / width;
    float warps[4] = {};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        if (32 * c >= units) break;  // warp-uniform
        float squares = 0.0f;
        for (int u = 32 * c + lane; u < units; u += 128)
            for (int d = u * width; d < (u + 1) * width; ++d) squares += to_float(row[d]) * to_float(row[d]);
        warps[c] = warp_sum(squares);
    }
    return (warps[0] + warps[2]) + (warps[1] + warps[3]);
}

// rms_norm's scale of a whole projection's row at 128 threads, bit for bit: thread t's units at
// t, t + 128, ... summed in turn, then block_sum. Every thread of the block must call it.
template <typename T>
__device__ __forceinline__ float whole_scale(const T* row, int hidden, float eps) {
    int width = hidden % 4 ? 1 : 4;
    float squares = 0.0f;
    for (int u = threadIdx.x; u < hidden / width; u += blockDim.x)
        for (int d = u * width; d < (u + 1) * width; ++d) squares += to_float(row[d]) * to_float(row[d]);
    return rsqrtf(block_sum(squares) / float(hidden) + eps);
}

// Element i of a row as rms_norm writes it (times scale and weight, rounded to T), or as it is
// where there is no norm (weight null).
template <typename T>
__device__ __forceinline__ float normed(const T* row, const T* weight, int i, float scale) {
    return weight ? to_float(from_float<T>(to_float(row[i]) * scale * to_float(weight[i]))) : to_float(row[i]);
}

// A warp's head of q or k (row x, its norm's weights w or null): normalised, rotated, and each
// rotated element d handed to store(d, value) rounded to T.
template <typename T, typename F>
__device__ __forceinline__ void rotate_head(const T* x, const T* w, float scale, const float* c, const float* s,
                                            int half, int lane, F store) {
#pragma unroll 2  // a head of 128 in one pass
    for (int i = lane; i < half; i += 32) {
        float x1 = normed(x, w, i, scale), x2 = normed(x, w, i + half, scale);
        store(i, from_float<T>(x1 * c[i] - x2 * s[i]));
        store(i + half, from_float<T>(x2 * c[i] + x1 * s[i]));
    }
}

template <typename T, typename C = T>
__global__ void __launch_bounds__(128, 8) rope_write_kv(  // 8 blocks an SM: at most 64 registers
    T* __restrict__ q_out, C* __restrict__ cache_k, C* __restrict__ cache_v, const T* __restrict__ qkv,
    const float* __restrict__ cos, const float* __restrict__ sin, const T* __restrict__ q_norm,
    const T* __restrict__ k_norm, const T* __restrict__ v_norm, const int* __restrict__ slots, int heads, int kv_heads,
    int head_dim, int width, long long cache_slots, int norm_whole, float eps) {
    int half = head_dim / 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    size_t t = blockIdx.x;
    const T* q = qkv + t * width;
    const T* k = q + width - size_t(2 * kv_heads) * head_dim;
    const T* v = k + size_t(kv_heads) * head_dim;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    bool per_head = q_norm && !norm_whole;
    float q_scale = 1.0f, k_scale = 1.0f;  // the whole projections' (OLMoE's), or a head's below
    if (q_norm && norm_whole) {  // block-uniform
        q_scale = whole_scale(q, heads * head_dim, eps);
        k_scale = whole_scale(k, kv_heads * head_dim, eps);
    }
    auto head_scale = [&](const T* x) { return rsqrtf(head_squares(x, head_dim, lane) / float(head_dim) + eps); };
    auto weight = [&](const T* norm, int h) { return norm && norm_whole ? norm + size_t(h) * head_dim : norm; };
    for (int h = warp; h < heads; h += warps) {  // warp-uniform
        const T* x = q + size_t(h) * head_dim;
        float scale = per_head ? head_scale(x) : q_scale;
        T* out = q_out + (t * heads + h) * head_dim;
        rotate_head(x, weight(q_norm, h), scale, c, s, half, lane, [&](int d, T value) { out[d] = value; });
    }
    long long slot = slots[t];
    if (slot < 0) return;  // padding: its q is computed, nothing is cached
    for (int h = warp; h < kv_heads; h += warps) {  // warp-uniform
        const T *x = k + size_t(h) * head_dim, *y = v + size_t(h) * head_dim;
        float scale = per_head ? head_scale(x) : k_scale, v_scale = v_norm ? head_scale(y) : 1.0f;
        if constexpr (KvCache<C>::scaled) {
            const T* w = weight(k_norm, h);
            size_t at = (size_t(h) * cache_slots + slot) * KvCache<C>::width(head_dim);
            write_fp8_row(cache_k + at, head_dim, lane, [&](int d) {  // as the float cache would hold it
                int i = d % half;
                float x1 = normed(x, w, i, scale), x2 = normed(x, w, i + half, scale);
                return to_float(from_float<T>(d < half ? x1 * c[i] - x2 * s[i] : x2 * c[i] + x1 * s[i]));
            });
            write_fp8_row(cache_v + at, head_dim, lane, [&](int d) { return normed(y, v_norm, d, v_scale); });
        } else {
            C* dst = cache_k + (size_t(h) * cache_slots + slot) * head_dim;
            rotate_head(x, weight(k_norm, h), scale, c, s, half, lane, [&](int d, T value) { dst[d] = value; });
            dst = cache_v + (size_t(h) * cache_slots + slot) * head_dim;
#pragma unroll 2
            for (int d = lane; d < head_dim; d += 32) dst[d] = v_norm ? from_float<T>(normed(y, v_norm, d, v_scale)) : y[d];
        }
    }
}
