// SiLU-and-mul: out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i], in fp32; GELU-and-mul
// the same with GELU's tanh form (Gemma's GeGLU); clamped_swiglu GPT-OSS's experts' form,
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
// Grid: (ceil(inter / blockDim.x), tokens).
#include "common.cuh"

struct Silu {
    __device__ __forceinline__ float operator()(float x) const { return x / (1.0f + __expf(-x)); }
};
struct GeluTanh {
    __device__ __forceinline__ float operator()(float x) const {
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    }
};

template <typename T, typename Act>
__device__ __forceinline__ void gated(T* __restrict__ out, const T* __restrict__ gate_up, int inter, Act act) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    size_t row = size_t(blockIdx.y);
    float gate = to_float(gate_up[row * 2 * inter + i]);
    float up = to_float(gate_up[row * 2 * inter + inter + i]);
    out[row * inter + i] = from_float<T>(act(gate) * up);
}

template <typename T>
__global__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inter) {
    gated(out, gate_up, inter, Silu());
}

template <typename T>
__global__ void gelu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inter) {
    gated(out, gate_up, inter, GeluTanh());
}

template <typename T>
__global__ void clamped_swiglu(T* __restrict__ out, const T* __restrict__ gate_up, int inter, float alpha,
                               float limit) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    size_t row = size_t(blockIdx.y);
    float gate = fminf(to_float(gate_up[row * 2 * inter + i]), limit);
    float up = fmaxf(-limit, fminf(to_float(gate_up[row * 2 * inter + inter + i]), limit));
    out[row * inter + i] = from_float<T>((up + 1.0f) * gate / (1.0f + __expf(-alpha * gate)));
}
