// Gated delta-net layers (Qwen3.5's linear attention) between their two projections, as
// model/ops/delta_rule.py computes them: the short causal convolution with SiLU, then per value
// head the gated delta rule (q and k L2-normalised, beta = sigmoid(b), g = decay * softplus(a +
// dt_bias)) and the gated RMSNorm of its output. Each request's state (fp32) lives in its slot;
// rows walk their tokens in order, so a row's state never depends on its neighbours or on how
// its prompt was chunked.
//
// proj: (tokens, projections) in the storage type, the fused input projection: q, k and v
// (channels), then z (values), then b and a (value_heads each). starts / counts / slots: each
// row's first token, token count and state slot.
#include "common.cuh"

#define CONV_TAPS_MAX 8

// Grid: (ceil(channels / blockDim.x), rows). A thread walks one channel of one row, its window
// of inputs in registers (window[CONV_TAPS_MAX - 1 - d]: d tokens back; every index a constant
// once unrolled); mixed: (tokens, channels) fp32; history: (slots, taps - 1, channels), oldest
// first.
template <typename T>
__global__ void delta_conv(float* __restrict__ mixed, float* __restrict__ history, const T* __restrict__ proj,
                           const float* __restrict__ weight, const int* __restrict__ starts,
                           const int* __restrict__ counts, const int* __restrict__ slots, int channels,
                           int projections, int taps) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (c >= channels) return;
    float* kept = history + size_t(slots[r]) * (taps - 1) * channels + c;
    const float* w = weight + size_t(c) * taps;
    float window[CONV_TAPS_MAX];
#pragma unroll
    for (int j = 0; j < CONV_TAPS_MAX - 1; ++j) {
        int back = CONV_TAPS_MAX - 1 - j;
        window[j] = back < taps ? kept[size_t(taps - 1 - back) * channels] : 0.0f;
    }
    for (int t = starts[r], end = starts[r] + counts[r]; t < end; ++t) {
        window[CONV_TAPS_MAX - 1] = to_float(proj[size_t(t) * projections + c]);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_TAPS_MAX; ++j) {  // oldest tap first
            int back = CONV_TAPS_MAX - 1 - j;
            if (back < taps) acc += window[j] * w[taps - 1 - back];
        }
        mixed[size_t(t) * channels + c] = acc / (1.0f + __expf(-acc));
#pragma unroll
        for (int j = 0; j < CONV_TAPS_MAX - 1; ++j) window[j] = window[j + 1];
    }
#pragma unroll
    for (int j = 0; j < CONV_TAPS_MAX - 1; ++j) {
        int back = CONV_TAPS_MAX - 1 - j;
        if (back < taps) kept[size_t(taps - 1 - back) * channels] = window[j];
    }
}

// Grid: (value_heads, rows), blockDim.x a multiple of 32 and at least value_dim and key_dim.
// Thread j keeps column j of its head's state (key_dim x value_dim, fp32, in its slot). out:
// (tokens, values) in the storage type, for out_proj.
template <typename T>
__global__ void delta_rule(T* __restrict__ out, float* __restrict__ state, const float* __restrict__ mixed,
                           const T* __restrict__ proj, const float* __restrict__ dt_bias,
                           const float* __restrict__ decay, const T* __restrict__ norm_weight,
                           const int* __restrict__ starts, const int* __restrict__ counts,
                           const int* __restrict__ slots, int key_heads, int value_heads, int key_dim,
                           int value_dim, int tiled, int projections, float eps) {
    __shared__ float q[256], k[256];
    int h = blockIdx.x, r = blockIdx.y, j = threadIdx.x;
    int per = value_heads / key_heads, kh = tiled ? h % key_heads : h / per;
    int keys = key_heads * key_dim, channels = 2 * keys + value_heads * value_dim;
    int values = value_heads * value_dim;
    float* s = state + (size_t(slots[r]) * value_heads + h) * key_dim * value_dim + j;  // column j
    float q_scale_dim = rsqrtf(float(key_dim));
    for (int t = starts[r], end = starts[r] + counts[r]; t < end; ++t) {
        const float* m = mixed + size_t(t) * channels;
        float qi = j < key_dim ? m[kh * key_dim + j] : 0.0f, ki = j < key_dim ? m[keys + kh * key_dim + j] : 0.0f;
        float q_norm = rsqrtf(block_sum(qi * qi) + 1e-6f), k_norm = rsqrtf(block_sum(ki * ki) + 1e-6f);
        if (j < key_dim) {
            q[j] = qi * q_norm * q_scale_dim;
            k[j] = ki * k_norm;
        }
        __syncthreads();
        const T* p = proj + size_t(t) * projections + channels + values;
        float b = to_float(p[h]), a = to_float(p[value_heads + h]) + dt_bias[h];
        float beta = 1.0f / (1.0f + __expf(-b));
        float g = decay[h] * (a > 20.0f ? a : log1pf(__expf(a)));
        float o = 0.0f;
        if (j < value_dim) {
            float fade = __expf(g), held = 0.0f;
            for (int i = 0; i < key_dim; ++i) {
                float v = s[size_t(i) * value_dim] * fade;
                s[size_t(i) * value_dim] = v;
                held += v * k[i];
            }
            float delta = (m[2 * keys + h * value_dim + j] - held) * beta;
            for (int i = 0; i < key_dim; ++i) {
                float v = s[size_t(i) * value_dim] + k[i] * delta;
                s[size_t(i) * value_dim] = v;
                o += v * q[i];
            }
        }
        float scale = rsqrtf(block_sum(o * o) / float(value_dim) + eps);
        if (j < value_dim) {
            float z = to_float(proj[size_t(t) * projections + channels + h * value_dim + j]);
            out[size_t(t) * values + h * value_dim + j] =
                from_float<T>(o * scale * to_float(norm_weight[j]) * (z / (1.0f + __expf(-z))));
        }
        __syncthreads();  // q and k are the next token's
    }
}

// x * sigmoid(gate), elementwise over (tokens, width): a gated attention's output.
// Grid: (ceil(width / blockDim.x), tokens).
template <typename T>
__global__ void sigmoid_mul(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ gate, int width) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= width) return;
    size_t row = blockIdx.y;
    float g = to_float(gate[row * width + i]);
    out[row * width + i] = from_float<T>(to_float(x[row * width + i]) / (1.0f + __expf(-g)));
}
