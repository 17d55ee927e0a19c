// Rotary embedding in place on q and k, Hugging Face's rotate-half layout, from the cos/sin
// tables the model builds (so llama3 and linear scaling come with them). One block per token;
// the threads walk (head, i) pairs of q's heads, then k's. x is (tokens, heads, head_dim) and
// cos/sin are (tokens, head_dim / 2), in fp32. scale_tokens: each token's row (all its heads)
// times its own factor (Llama 4's attention temperature, from the model's table by position).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rotate(T* x, int heads, int half, const float* cos, const float* sin) {
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        int head = j / half, i = j % half;
        T* v = x + size_t(head) * 2 * half;
        float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
        v[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
        v[i + half] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
    }
}

template <typename T>
__global__ void rotary(T* __restrict__ q, T* __restrict__ k, const float* __restrict__ cos,
                       const float* __restrict__ sin, int q_heads, int kv_heads, int head_dim) {
    int half = head_dim / 2;
    size_t t = blockIdx.x;
    rotate(q + t * q_heads * head_dim, q_heads, half, cos + t * half, sin + t * half);
    rotate(k + t * kv_heads * head_dim, kv_heads, half, cos + t * half, sin + t * half);
}

template <typename T>
__global__ void scale_tokens(T* __restrict__ x, const float* __restrict__ factors, int width) {
    size_t t = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        x[t * width + i] = from_float<T>(to_float(x[t * width + i]) * factors[t]);
}
