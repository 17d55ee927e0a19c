// The CPU shim: runs Spool's unmodified .cu kernels on the CPU so that CI, which has no GPU,
// tests them. tests/cuda_harness.py compiles a kernel file with g++ and this header and loads it
// with ctypes. One OS thread: each CUDA thread of a block is a fiber (ucontext) and the blocks of
// a grid run one after another, so __shared__ can be a static, atomics need no atomicity, and a
// barrier that can never complete is reported as a deadlock instead of hanging. The CUDA subset
// it covers is listed in cuda/README.md.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define SPOOL_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(spool_shim::dynamic_smem())

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline dim3 blockIdx, blockDim, gridDim;
constexpr int warpSize = 32;

using std::max;
using std::min;

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline float __uint_as_float(unsigned i) { return std::bit_cast<float>(i); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
template <typename T> inline T __ldg(const T* p) { return *p; }

// Half and bfloat16: storage types with CUDA's conversion functions (round to nearest even).
struct __half {
    _Float16 value;
};
inline float __half2float(__half h) { return float(h.value); }
inline __half __float2half_rn(float f) { return {_Float16(f)}; }

struct __nv_bfloat16 {
    uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) { return std::bit_cast<float>(uint32_t(h.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
}

namespace spool_shim {

constexpr size_t kStack = 64 * 1024;

struct Fiber {
    ucontext_t context;
    dim3 index;
    bool done = false;
};

// Everything about the block that runs now.
struct Block {
    std::vector<Fiber> fibers;
    std::vector<std::vector<char>> stacks;
    ucontext_t scheduler;
    int current = 0;
    int alive = 0;
    int arrived = 0;
    unsigned generation = 0;
    std::vector<int> warp_alive, warp_arrived;
    std::vector<unsigned> warp_generation;
    std::vector<uint64_t> lanes;  // 32 shuffle slots per warp
    std::vector<char> shared;
    std::function<void()> body;
    bool progress = false;
};

inline Block& block() {
    static Block b;
    return b;
}
inline const dim3& current_thread() { return block().fibers[block().current].index; }
inline void* dynamic_smem() { return block().shared.data(); }
inline int linear_id() {
    const dim3& t = current_thread();
    return int(t.x + blockDim.x * (t.y + blockDim.y * t.z));
}
inline void yield() {
    Block& b = block();
    swapcontext(&b.fibers[b.current].context, &b.scheduler);
}

inline void release_if_complete() {
    Block& b = block();
    if (b.arrived > 0 && b.arrived == b.alive) {
        b.arrived = 0;
        ++b.generation;
    }
    for (size_t w = 0; w < b.warp_alive.size(); ++w) {
        if (b.warp_arrived[w] > 0 && b.warp_arrived[w] == b.warp_alive[w]) {
            b.warp_arrived[w] = 0;
            ++b.warp_generation[w];
        }
    }
}

inline void sync_block() {
    Block& b = block();
    unsigned seen = b.generation;
    ++b.arrived;
    b.progress = true;
    release_if_complete();
    while (b.generation == seen) yield();
}

inline void sync_warp() {
    Block& b = block();
    int w = linear_id() / 32;
    unsigned seen = b.warp_generation[w];
    ++b.warp_arrived[w];
    b.progress = true;
    release_if_complete();
    while (b.warp_generation[w] == seen) yield();
}

template <typename T> inline T shuffle(T value, int from_lane) {
    static_assert(sizeof(T) <= sizeof(uint64_t));
    Block& b = block();
    int id = linear_id(), w = id / 32;
    std::memcpy(&b.lanes[id], &value, sizeof(T));
    sync_warp();
    T out = value;
    int lanes_in_warp = std::min(32, int(b.fibers.size()) - w * 32);
    if (from_lane >= 0 && from_lane < lanes_in_warp) std::memcpy(&out, &b.lanes[w * 32 + from_lane], sizeof(T));
    sync_warp();
    return out;
}

inline void fiber_entry() {
    Block& b = block();
    b.body();
    b.fibers[b.current].done = true;
    --b.alive;
    --b.warp_alive[linear_id() / 32];
    b.progress = true;
    release_if_complete();
}  // returns to the scheduler through uc_link

// Run one block to the end; false on a deadlock (every live thread waits and none can go on).
inline bool run_block(int threads) {
    Block& b = block();
    b.alive = threads;
    b.arrived = 0;
    int warps = (threads + 31) / 32;
    b.warp_alive.assign(warps, 32);
    b.warp_alive.back() = threads - 32 * (warps - 1);
    b.warp_arrived.assign(warps, 0);
    b.warp_generation.assign(warps, 0);
    b.lanes.assign(size_t(warps) * 32, 0);
    for (int i = 0; i < threads; ++i) {
        Fiber& f = b.fibers[i];
        f.done = false;
        f.index = {unsigned(i % blockDim.x), unsigned(i / blockDim.x % blockDim.y), unsigned(i / (blockDim.x * blockDim.y))};
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = b.stacks[i].data();
        f.context.uc_stack.ss_size = kStack;
        f.context.uc_link = &b.scheduler;
        makecontext(&f.context, fiber_entry, 0);
    }
    while (b.alive > 0) {
        b.progress = false;
        for (int i = 0; i < threads; ++i) {
            if (b.fibers[i].done) continue;
            b.current = i;
            swapcontext(&b.scheduler, &b.fibers[i].context);
        }
        if (!b.progress && b.alive > 0) return false;
    }
    return true;
}

template <typename... A, size_t... I>
inline void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

// The launch ABI the harness calls: cuLaunchKernel's, with the kernel's parameters unpacked
// from void** by the kernel's own signature. Returns 0, or -1 on a deadlock.
template <typename... A>
inline int launch(void (*kernel)(A...), const unsigned* grid, const unsigned* threads, size_t shared_bytes,
                  void** args) {
    Block& b = block();
    blockDim = {threads[0], threads[1], threads[2]};
    gridDim = {grid[0], grid[1], grid[2]};
    int n = int(threads[0] * threads[1] * threads[2]);
    b.fibers.resize(n);
    if (int(b.stacks.size()) < n) b.stacks.resize(n, std::vector<char>(kStack));
    b.shared.assign(shared_bytes + 16, char(0xA5));  // poisoned, as uninitialised shared memory may be
    b.body = [&] { call(kernel, args, std::index_sequence_for<A...>{}); };
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x) {
                blockIdx = {x, y, z};
                if (!run_block(n)) {
                    std::fprintf(stderr, "spool_shim: deadlock in block (%u, %u, %u)\n", x, y, z);
                    return -1;
                }
            }
    return 0;
}

}  // namespace spool_shim

#define threadIdx (spool_shim::current_thread())
inline void __syncthreads() { spool_shim::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { spool_shim::sync_warp(); }
template <typename T> inline T __shfl_sync(unsigned, T v, int lane, int = 32) { return spool_shim::shuffle(v, lane); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return spool_shim::shuffle(v, (spool_shim::linear_id() % 32) ^ mask);
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, unsigned delta, int = 32) {
    return spool_shim::shuffle(v, int(spool_shim::linear_id() % 32 + delta));
}
// __match_any_sync: the lanes of the warp holding the same value as this one; __ballot_sync: those
// whose predicate holds; __reduce_add_sync:
// the sum over the lanes of mask (each lane names its own group, as CUDA allows when the groups
// are disjoint). Every lane of the warp must call them, as with the shuffles above.
template <typename T> inline unsigned __match_any_sync(unsigned, T v) {
    static_assert(sizeof(T) <= sizeof(uint64_t));
    spool_shim::Block& b = spool_shim::block();
    int id = spool_shim::linear_id(), w = id / 32;
    uint64_t mine = 0;
    std::memcpy(&mine, &v, sizeof(T));
    b.lanes[id] = mine;
    spool_shim::sync_warp();
    unsigned mask = 0;
    int lanes_in_warp = std::min(32, int(b.fibers.size()) - w * 32);
    for (int l = 0; l < lanes_in_warp; ++l) mask |= unsigned(b.lanes[w * 32 + l] == mine) << l;
    spool_shim::sync_warp();
    return mask;
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
    spool_shim::Block& b = spool_shim::block();
    int id = spool_shim::linear_id(), w = id / 32;
    b.lanes[id] = v;
    spool_shim::sync_warp();
    unsigned sum = 0;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u) sum += unsigned(b.lanes[w * 32 + l]);
    spool_shim::sync_warp();
    return sum;
}
inline unsigned __ballot_sync(unsigned, int predicate) {
    spool_shim::Block& b = spool_shim::block();
    int id = spool_shim::linear_id(), w = id / 32;
    b.lanes[id] = predicate != 0;
    spool_shim::sync_warp();
    unsigned mask = 0;
    int lanes_in_warp = std::min(32, int(b.fibers.size()) - w * 32);
    for (int l = 0; l < lanes_in_warp; ++l) mask |= unsigned(b.lanes[w * 32 + l] != 0) << l;
    spool_shim::sync_warp();
    return mask;
}
inline int __reduce_add_sync(unsigned mask, int v) { return int(__reduce_add_sync(mask, unsigned(v))); }
inline int __popc(unsigned v) { return std::popcount(v); }
inline int __ffs(int v) { return v ? std::countr_zero(unsigned(v)) + 1 : 0; }
inline int __ffs(unsigned v) { return __ffs(int(v)); }
inline void __threadfence() {}  // one block at a time: every earlier block's writes are already seen
template <typename T> inline T atomicAdd(T* address, T value) {
    T old = *address;
    *address = old + value;
    return old;
}
template <typename T> inline T atomicMin(T* address, T value) {
    T old = *address;
    *address = std::min(old, value);
    return old;
}
template <typename T> inline T atomicMax(T* address, T value) {
    T old = *address;
    *address = std::max(old, value);
    return old;
}

// Tensor cores through WMMA (<mma.h>): the warp-collective load, mma, store and fill on 16 x 16 x
// 16 tiles. A fragment's layout across the lanes is unspecified in CUDA; here every lane holds
// the whole tile in fp32 (the 16-bit values are exact in it) and does the whole product, which
// is what a kernel that only loads, multiplies and stores fragments can observe. Elementwise
// access to a fragment's x[] is layout-dependent in CUDA: kernels must not use it.
#define __align__(n) __attribute__((aligned(n)))
namespace nvcuda::wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
    static constexpr int num_elements = rows * cols;
    float x[rows * cols];
};

inline float element(float v) { return v; }
inline float element(__half v) { return __half2float(v); }
inline float element(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
    using F = fragment<Use, M, N, K, T, Layout>;
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] = element(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm, layout_t layout) {
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K>
inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * N + c];
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float v) {
    for (float& x : f.x) x = v;
}

template <int M, int N, int K, typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
                     const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
    float out[M * N];
    for (int r = 0; r < M; ++r)
        for (int col = 0; col < N; ++col) {
            float sum = c.x[r * N + col];
            for (int k = 0; k < K; ++k) sum += a.x[r * K + k] * b.x[k * N + col];
            out[r * N + col] = sum;
        }
    std::copy(out, out + M * N, d.x);
}
}  // namespace nvcuda::wmma
