// SiLU-and-mul: out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i], in fp32; GELU-and-mul
// the same with GELU's tanh form (Gemma's GeGLU).
// Grid: (ceil(inter / blockDim.x), tokens).
#include "common.cuh"

template <typename T>
__global__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inter) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    size_t row = size_t(blockIdx.y);
    float gate = to_float(gate_up[row * 2 * inter + i]);
    float up = to_float(gate_up[row * 2 * inter + inter + i]);
    out[row * inter + i] = from_float<T>(gate / (1.0f + __expf(-gate)) * up);
}

template <typename T>
__global__ void gelu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inter) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    size_t row = size_t(blockIdx.y);
    float gate = to_float(gate_up[row * 2 * inter + i]);
    float up = to_float(gate_up[row * 2 * inter + inter + i]);
    float inner = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
    out[row * inter + i] = from_float<T>(0.5f * gate * (1.0f + tanhf(inner)) * up);
}
