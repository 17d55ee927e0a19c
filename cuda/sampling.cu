// Sampling, one block per row of fp32 logits (penalties and logit bias already applied):
// greedy (temperature 0) is the argmax, lowest id on ties; otherwise softmax at the row's
// temperature, then the kept set: top-k, top-p over the renormalised top-k, and min-p against
// the most likely token, each a probability threshold found by bisection (block-wide counts
// and sums, so no sort of the vocabulary); then one inverse-CDF draw over the kept tokens in id
// order with the row's uniform u, which the host takes from seeded_uniform(seed, index) for a
// seeded row, so a row's token never depends on the rest of the batch. A row whose logits hold
// no finite value (NaN or -inf throughout: a model that overflowed) gets -1, no token, which the
// host fails its request on and no kernel indexes with.
// Block size: a power of two, multiple of 32, at most 1024.
#include "common.cuh"

#define SAMPLE_BISECTIONS 40

// Probability of token i relative to the most likely one (which is 1), at temperature t.
__device__ __forceinline__ float weight(const float* row, int i, float top, float inv_t) {
    return __expf((row[i] - top) * inv_t);
}

// Sum (or count) of the weights >= v over the vocabulary.
__device__ __forceinline__ float mass_above(const float* row, int vocab, float top, float inv_t, float v, bool count) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float w = weight(row, i, top, inv_t);
        if (w >= v) s += count ? 1.0f : w;
    }
    return block_sum(s);
}

__global__ void sample(int* __restrict__ out, const float* __restrict__ logits, const float* __restrict__ temperature,
                       const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                       const float* __restrict__ uniform, int vocab) {
    int r = blockIdx.x;
    const float* row = logits + size_t(r) * vocab;
    float m = neg_inf();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, row[i]);
    float top = block_max(m);
    if (!(top > neg_inf() && top < -neg_inf())) {  // NaN compares false
        if (threadIdx.x == 0) out[r] = -1;
        return;
    }

    __shared__ int s_choice;
    if (temperature[r] <= 0.0f) {  // greedy: the lowest id holding the maximum
        if (threadIdx.x == 0) s_choice = vocab;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (row[i] == top) atomicMin(&s_choice, i);
        __syncthreads();
        if (threadIdx.x == 0) out[r] = s_choice;
        return;
    }
    float inv_t = 1.0f / temperature[r];

    // The threshold: kept tokens have weight >= floor.
    float floor = min_p[r] > 0.0f ? min_p[r] : 0.0f;
    int k = top_k[r];
    if (k > 0 && k < vocab) {  // the largest v with at least k weights >= v
        float lo = 0.0f, hi = 1.0f;
        for (int it = 0; it < SAMPLE_BISECTIONS; ++it) {
            float mid = 0.5f * (lo + hi);
            if (mass_above(row, vocab, top, inv_t, mid, true) >= float(k)) lo = mid; else hi = mid;
        }
        floor = fmaxf(floor, lo);
    }
    if (top_p[r] < 1.0f) {  // the largest v whose heavier tokens still hold top_p of the kept mass
        float kept = mass_above(row, vocab, top, inv_t, floor, false), target = top_p[r] * kept;
        float lo = floor, hi = 1.0f;
        for (int it = 0; it < SAMPLE_BISECTIONS; ++it) {
            float mid = 0.5f * (lo + hi);
            if (mass_above(row, vocab, top, inv_t, mid, false) >= target) lo = mid; else hi = mid;
        }
        floor = fmaxf(floor, lo);
    }

    // Inverse CDF over the kept tokens in id order: each thread owns a contiguous span.
    int span = (vocab + blockDim.x - 1) / blockDim.x, begin = threadIdx.x * span, end = min(vocab, begin + span);
    float mine = 0.0f;
    for (int i = begin; i < end; ++i) {
        float w = weight(row, i, top, inv_t);
        if (w >= floor) mine += w;
    }
    __shared__ float s_span[1024];
    s_span[threadIdx.x] = mine;
    if (threadIdx.x == 0) s_choice = -1;
    __syncthreads();
    if (threadIdx.x == 0) {  // the span that holds the draw, and how much of it is left to walk
        float total = 0.0f;
        for (int t = 0; t < int(blockDim.x); ++t) total += s_span[t];
        float goal = uniform[r] * total, before = 0.0f;
        int chosen = -1, last = 0;
        for (int t = 0; t < int(blockDim.x) && chosen < 0; ++t) {
            if (s_span[t] == 0.0f) continue;
            last = t;
            if (before + s_span[t] > goal) chosen = t; else before += s_span[t];
        }
        if (chosen < 0) chosen = last;  // u * total rounded up to the end: the last kept token
        s_span[0] = goal - before;
        s_choice = chosen;
    }
    __syncthreads();
    if (int(threadIdx.x) == s_choice) {
        float left = s_span[0];
        int last = -1, pick = -1;
        for (int i = begin; i < end && pick < 0; ++i) {
            float w = weight(row, i, top, inv_t);
            if (w < floor) continue;
            last = i;
            if (left < w) pick = i; else left -= w;
        }
        out[r] = pick >= 0 ? pick : last;  // rounding past the end keeps the last kept token
    }
}
