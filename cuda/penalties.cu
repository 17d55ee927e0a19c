// Logit bias and penalties, in place on fp32 logits, one block per row, from token counts kept
// on the device per row (count_tokens adds each step's sampled token; nothing is rebuilt from
// the history). The order and the rules are numpy_ops.sample's: first the bias, then the
// repetition penalty over tokens seen in the prompt or the output (transformers' rule: divide a
// positive logit, multiply a negative one), then presence and frequency over the output
// (OpenAI's: subtract).
//
// output_counts: (slots, vocab) int32 and prompt_seen: (slots, vocab) uint8, one slot per
// request that asks for penalties; count_rows: (rows) int32, the slot of each row of logits, or
// -1 for a row without penalties (then only its bias applies);
// bias_offsets: (rows + 1) int32 into bias_ids / bias_values (a row's entries are distinct ids).
#include "common.cuh"

__global__ void apply_penalties(float* __restrict__ logits, const int* __restrict__ output_counts,
                                const unsigned char* __restrict__ prompt_seen, const int* __restrict__ count_rows,
                                const float* __restrict__ repetition,
                                const float* __restrict__ presence, const float* __restrict__ frequency,
                                const int* __restrict__ bias_offsets, const int* __restrict__ bias_ids,
                                const float* __restrict__ bias_values, int vocab) {
    size_t base = size_t(blockIdx.x) * vocab;
    for (int j = bias_offsets[blockIdx.x] + threadIdx.x; j < bias_offsets[blockIdx.x + 1]; j += blockDim.x)
        logits[base + bias_ids[j]] += bias_values[j];
    int slot = count_rows[blockIdx.x];
    if (slot < 0) return;
    __syncthreads();
    size_t counts = size_t(slot) * vocab;
    float rep = repetition[blockIdx.x], pres = presence[blockIdx.x], freq = frequency[blockIdx.x];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        int count = output_counts[counts + i];
        float l = logits[base + i];
        if (rep != 1.0f && (count > 0 || prompt_seen[counts + i])) l = l > 0.0f ? l / rep : l * rep;
        l -= freq * float(count) + (count > 0 ? pres : 0.0f);
        logits[base + i] = l;
    }
}

// After a step: each row's sampled token counts once more in its slot (slots are distinct, so
// no atomics); a row without a token (-1) counts nothing. One thread per row.
__global__ void count_tokens(int* __restrict__ output_counts, const int* __restrict__ count_rows,
                             const int* __restrict__ tokens, int rows, int vocab) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && count_rows[r] >= 0 && tokens[r] >= 0 && tokens[r] < vocab)
        output_counts[size_t(count_rows[r]) * vocab + tokens[r]] += 1;
}
