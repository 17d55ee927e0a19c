// Sampling, one block per row of fp32 logits (penalties and logit bias already applied):
// greedy (temperature 0) is the argmax, lowest id on ties; otherwise softmax at the row's
// temperature, then the kept set: top-k, top-p over the renormalised top-k, and min-p and top-nσ
// against the most likely token (top-nσ: logits n standard deviations of the finite ones below the
// largest, or nearer), each a threshold on the tokens' weights (probability relative to the
// most likely, in (0, 1]); then one inverse-CDF draw over the kept tokens in id order with the
// row's uniform u, which the host takes from seeded_uniform(seed, index) for a seeded row, so a
// row's token never depends on the rest of the batch. A row whose logits hold no finite value
// (NaN or -inf throughout: a model that overflowed) gets -1, no token, which the host fails its
// request on and no kernel indexes with.
//
// The top-k and top-p thresholds are radix selects over the weights' float bits (non-negative
// floats order as their bits): four passes of 8 bits each, a histogram per pass in shared
// memory, exact where bisection took 40 passes and came within 2^-40. Histograms count in
// integers (masses in fixed point, 2^-40 a unit), so no float atomics: the same row gives the
// same threshold every run. Each warp first groups its lanes by bin (__match_any_sync) and adds
// a group's counts in 32 bits (__popc; masses as two 20-bit halves by __reduce_add_sync), so a
// warp makes one shared atomic per distinct bin instead of one per token (and a warp none of
// whose tokens is in the pass, found by __ballot_sync, skips the grouping): most of a row's tokens
// fall in a few bins, where 32 lanes' atomics on one address serialise. Integer sums, so the
// same totals in any order: results are those of one atomic per token.
// Block size: a power of two, multiple of 32, at most 1024.
#include "common.cuh"

#define SAMPLE_BINS 256
#define MASS_UNIT 1099511627776.0f  // 2^40: a weight <= 1 in fixed point; 128k of them fit 2^57

// Probability of token i relative to the most likely one (which is 1), at temperature t.
__device__ __forceinline__ float weight(const float* row, int i, float top, float inv_t) {
    return __expf((row[i] - top) * inv_t);
}

// The largest weight v among those >= floor such that the tokens of weight >= v number at least
// goal (count; top-k's k) or hold at least goal of the mass of all tokens >= floor (top-p's p).
// floor where no v does (fewer than k tokens are left). Every thread gets it.
__device__ float threshold(const float* row, int vocab, float top, float inv_t, float floor, bool count,
                           float goal) {
    __shared__ unsigned s_count[SAMPLE_BINS];           // top-k: tokens a bin (at most vocab)
    __shared__ unsigned long long s_mass[SAMPLE_BINS];  // top-p: mass a bin, 2^-40 a unit
    __shared__ unsigned long long s_above, s_target;
    __shared__ unsigned s_prefix;
    __shared__ int s_found;
    if (threadIdx.x == 0) {
        s_above = 0;
        s_prefix = 0;
        s_found = 1;
    }
    int lane = threadIdx.x & 31;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
            s_count[b] = 0;
            s_mass[b] = 0;
        }
        __syncthreads();
        unsigned prefix = s_prefix, high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        if (s_found) {
            // Warp-uniform trip count (blockDim is a multiple of 32): every lane reaches the
            // warp intrinsics; lanes past the row or out of this pass's prefix take bin SAMPLE_BINS.
            for (int base = threadIdx.x - lane; base < vocab; base += blockDim.x) {
                int i = base + lane, bin = SAMPLE_BINS;
                float w = 0.0f;
                if (i < vocab) {
                    w = weight(row, i, top, inv_t);
                    unsigned bits = __float_as_uint(w);
                    if (w >= floor && (bits & high) == prefix) bin = (bits >> shift) & (SAMPLE_BINS - 1);
                }
                if (!__ballot_sync(0xffffffffu, bin < SAMPLE_BINS)) continue;  // past the first pass, most warps
                unsigned peers = __match_any_sync(0xffffffffu, bin);
                bool leader = lane == __ffs(peers) - 1;
                if (count) {
                    if (leader && bin < SAMPLE_BINS) atomicAdd(&s_count[bin], unsigned(__popc(peers)));
                } else {
                    unsigned long long mass = bin < SAMPLE_BINS ? (unsigned long long)(w * MASS_UNIT) : 0ull;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
                    unsigned high_part = __reduce_add_sync(peers, unsigned(mass >> 20));  // at most 2^20 each
                    unsigned low_part = __reduce_add_sync(peers, unsigned(mass & 0xfffffu));
                    if (leader && bin < SAMPLE_BINS)
                        atomicAdd(&s_mass[bin], ((unsigned long long)high_part << 20) + low_part);
#else  // no __reduce_add_sync before sm_80: each lane's own add (integers: the same sums)
                    if (bin < SAMPLE_BINS) atomicAdd(&s_mass[bin], mass);
#endif
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0 && s_found) {
            if (shift == 24) {  // every kept token is in this pass's histogram: the goal in its units
                unsigned long long total = 0;
                for (int b = 0; b < SAMPLE_BINS; ++b) total += count ? s_count[b] : s_mass[b];
                s_target = count ? (unsigned long long)goal : (unsigned long long)(double(total) * double(goal));
                if (s_target > total) s_found = 0;
            }
            unsigned long long above = s_above;
            int chosen = 0;
            for (int b = SAMPLE_BINS - 1; b >= 0 && s_found; --b) {
                unsigned long long here = count ? s_count[b] : s_mass[b];
                if (above + here >= s_target) {
                    chosen = b;
                    break;
                }
                above += here;
            }
            s_above = above;
            s_prefix = prefix | (unsigned(chosen) << shift);
        }
        __syncthreads();
    }
    float v = s_found ? fmaxf(floor, __uint_as_float(s_prefix)) : floor;
    __syncthreads();  // the shared state is reused by the next call
    return v;
}

__global__ void sample(int* __restrict__ out, const float* __restrict__ logits, const float* __restrict__ temperature,
                       const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                       const float* __restrict__ top_n_sigma, const float* __restrict__ uniform, int vocab) {
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
    if (top_n_sigma[r] > 0.0f) {  // the finite logits' standard deviation, from their gaps below the largest
        float sum = 0.0f, squares = 0.0f, finite = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float gap = row[i] - top;
            if (gap > neg_inf()) {
                sum += gap;
                squares += gap * gap;
                finite += 1.0f;
            }
        }
        sum = block_sum(sum);
        squares = block_sum(squares);
        finite = block_sum(finite);
        float mean = sum / finite, sigma = sqrtf(fmaxf(squares / finite - mean * mean, 0.0f));
        floor = fmaxf(floor, __expf(-top_n_sigma[r] * sigma * inv_t));
    }
    int k = top_k[r];
    if (k > 0 && k < vocab) floor = threshold(row, vocab, top, inv_t, floor, true, float(k));
    if (top_p[r] < 1.0f) floor = threshold(row, vocab, top, inv_t, floor, false, top_p[r]);

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
