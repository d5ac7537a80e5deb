// A CPU emulation of the little CUDA that worker/src/gpu/kernels.cu uses, so that the file
// compiles unchanged with g++ (include this header, then the .cu) and its kernels run on the
// CPU, faithfully enough to check their indexing, tiling, reductions and barriers.
//
// `launch(grid, block, shared_bytes, f)` runs the grid's blocks one after another; each block
// runs with one real std::thread per CUDA thread (started once per launch, reused block after
// block), so __syncthreads and warp shuffles are real barriers between real threads. Because only one block runs at a time, a function-local
// `static` is that block's shared memory (`__shared__` becomes `static`).
//
// It is strict where CUDA's rules are: the process fails with a message naming the kernel's
// source line, instead of passing, when
//   - a __syncthreads is reached by only some of the block's threads (the others exited),
//     or by threads at different __syncthreads calls, or does not complete within
//     kBarrierTimeout (a deadlock, e.g. threads waiting at a warp shuffle and at
//     __syncthreads);
//   - a warp shuffle with the full mask runs in a partial warp, or with only some lanes;
//   - a launch breaks CUDA's limits (1024 threads a block, 48 KiB of shared memory);
//   - a kernel writes past the end of its dynamic shared memory (checked after each block;
//     the buffer starts as NaN, so reading memory no thread wrote shows up too).
//
// It does not emulate: the PTX or the compiler's code for it, real warp scheduling (lanes
// of a warp are independent threads here, synchronised only at shuffles), the GPU memory
// model (all threads see one coherent memory; barriers here are also full fences), atomics,
// or the driver's argument passing.
#pragma once

#include <bit>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <memory>
#include <mutex>
#include <source_location>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __restrict__
#define __shared__ static
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(cuda_emu::dynamic_shared())

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace cuda_emu {

// How long a barrier waits before the emulation calls it a deadlock.
inline constexpr std::chrono::seconds kBarrierTimeout{20};
// Bytes of guard after the dynamic shared memory, checked after each block.
inline constexpr size_t kSharedGuard = 256;

[[noreturn]] inline void fail(const char* fmt, auto... args) {
    std::fprintf(stderr, "CUDA EMULATION ERROR: ");
    if constexpr (sizeof...(args) == 0) {
        std::fputs(fmt, stderr);
    } else {
        std::fprintf(stderr, fmt, args...);
    }
    std::fprintf(stderr, " (block %u,%u,%u thread %u,%u,%u)\n", blockIdx.x, blockIdx.y, blockIdx.z,
                 threadIdx.x, threadIdx.y, threadIdx.z);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(3);
}

// A barrier over `count` threads that knows which threads have exited the kernel, so that a
// barrier only some threads can reach fails at once instead of hanging, and that checks every
// thread of a phase arrived from the same call site.
class Barrier {
public:
    Barrier(unsigned count, const char* what) : count_(count), what_(what) {}

    void arrive_and_wait(const std::source_location& loc) {
        std::unique_lock lk(mu_);
        if (arrived_ == 0) {
            site_ = loc;
        } else if (site_.line() != loc.line() || std::strcmp(site_.file_name(), loc.file_name()) != 0) {
            fail("divergent %s: threads of one phase reached it at line %u and at line %u", what_,
                 (unsigned)site_.line(), (unsigned)loc.line());
        }
        ++arrived_;
        check_reachable();
        if (arrived_ == count_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        uint64_t gen = generation_;
        if (!cv_.wait_for(lk, kBarrierTimeout, [&] { return generation_ != gen; })) {
            fail("%s at line %u: only %u of %u threads arrived within %lld s (deadlock)", what_,
                 (unsigned)site_.line(), arrived_, count_, (long long)kBarrierTimeout.count());
        }
    }

    // The calling thread returned from the kernel.
    void thread_exited() {
        std::lock_guard lk(mu_);
        ++exited_;
        check_reachable();
    }

private:
    void check_reachable() {
        if (arrived_ > 0 && exited_ > 0 && arrived_ + exited_ >= count_) {
            fail("%s at line %u reached by %u of %u threads; the other %u returned from the kernel "
                 "(divergent barrier)",
                 what_, (unsigned)site_.line(), arrived_, count_, exited_);
        }
    }

    std::mutex mu_;
    std::condition_variable cv_;
    unsigned count_;
    const char* what_;
    unsigned arrived_ = 0;
    unsigned exited_ = 0;
    uint64_t generation_ = 0;
    std::source_location site_;
};

struct Warp {
    Warp(unsigned lanes) : lanes(lanes), bar(lanes, "__shfl_down_sync") {}
    unsigned lanes;
    Barrier bar;
    uint64_t slots[32] = {};
};

// The block that is running (blocks run one at a time).
struct Block {
    Block(unsigned threads, size_t shared_bytes)
        : threads(threads), bar(threads, "__syncthreads"), shared(shared_bytes + kSharedGuard, 0xff),
          shared_bytes(shared_bytes) {
        for (unsigned w = 0; w * 32 < threads; ++w) {
            unsigned lanes = threads - w * 32 < 32 ? threads - w * 32 : 32;
            warps.push_back(std::make_unique<Warp>(lanes));
        }
    }
    unsigned threads;
    Barrier bar;
    std::vector<std::unique_ptr<Warp>> warps;
    // Starts as all-ones bytes (NaN as floats): reading memory no thread wrote shows up.
    std::vector<unsigned char> shared;
    size_t shared_bytes;
};

inline Block* current = nullptr;

inline unsigned linear_tid() {
    return threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
}

inline void* dynamic_shared() {
    if (current->shared_bytes == 0) fail("DYNAMIC_SHARED in a launch with 0 bytes of shared memory");
    return current->shared.data();
}

}  // namespace cuda_emu

inline void __syncthreads(std::source_location loc = std::source_location::current()) {
    cuda_emu::current->bar.arrive_and_wait(loc);
}

template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta,
                   std::source_location loc = std::source_location::current()) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
    unsigned tid = cuda_emu::linear_tid();
    cuda_emu::Warp& w = *cuda_emu::current->warps[tid / 32];
    unsigned lane = tid % 32;
    if (mask != 0xffffffffu) cuda_emu::fail("__shfl_down_sync at line %u: only the full mask is emulated", (unsigned)loc.line());
    if (w.lanes != 32) {
        cuda_emu::fail("__shfl_down_sync at line %u with the full mask in a partial warp of %u lanes",
                       (unsigned)loc.line(), w.lanes);
    }
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    w.slots[lane] = bits;
    w.bar.arrive_and_wait(loc);
    T out = var;  // lanes whose source is past the warp keep their own value
    if (lane + delta < 32) std::memcpy(&out, &w.slots[lane + delta], sizeof(T));
    // Nobody overwrites a slot before every lane has read it.
    w.bar.arrive_and_wait(loc);
    return out;
}

namespace cuda_emu {

// Runs `kernel` (a callable taking no arguments, e.g. a lambda calling the kernel function)
// over `grid` blocks of `block` threads with `shared_bytes` of dynamic shared memory.
template <class F>
void launch(dim3 grid, dim3 block, size_t shared_bytes, F&& kernel) {
    unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) fail("launch with an empty grid or block");
    if (threads > 1024) fail("launch with %u threads a block (CUDA's limit is 1024)", threads);
    if (block.z > 64) fail("launch with blockDim.z %u (CUDA's limit is 64)", block.z);
    if (grid.y > 65535 || grid.z > 65535) fail("launch with gridDim.y/z over 65535");
    if (shared_bytes > 48 * 1024) fail("launch with %zu bytes of dynamic shared memory (default limit 48 KiB)", shared_bytes);
    gridDim = grid;
    blockDim = block;
    // One real thread per CUDA thread of a block, started once per launch and reused for
    // every block: the launching thread hands them one block at a time (a fresh Block: its
    // barriers, warps and dynamic shared memory) and waits until all of them are done with it.
    struct Gate {
        std::mutex mu;
        std::condition_variable start, done;
        uint64_t generation = 0;
        unsigned finished = 0;
        bool stop = false;
        dim3 block_idx;
    } gate;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned tz = 0; tz < block.z; ++tz) {
        for (unsigned ty = 0; ty < block.y; ++ty) {
            for (unsigned tx = 0; tx < block.x; ++tx) {
                pool.emplace_back([&, tx, ty, tz] {
                    threadIdx = dim3(tx, ty, tz);
                    uint64_t seen = 0;
                    for (;;) {
                        {
                            std::unique_lock lk(gate.mu);
                            gate.start.wait(lk, [&] { return gate.stop || gate.generation != seen; });
                            if (gate.stop) return;
                            seen = gate.generation;
                            blockIdx = gate.block_idx;
                        }
                        kernel();
                        current->bar.thread_exited();
                        current->warps[linear_tid() / 32]->bar.thread_exited();
                        std::lock_guard lk(gate.mu);
                        if (++gate.finished == threads) gate.done.notify_one();
                    }
                });
            }
        }
    }
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block b(threads, shared_bytes);
                {
                    std::unique_lock lk(gate.mu);
                    current = &b;
                    gate.block_idx = dim3(bx, by, bz);
                    gate.finished = 0;
                    ++gate.generation;
                    gate.start.notify_all();
                    gate.done.wait(lk, [&] { return gate.finished == threads; });
                    current = nullptr;
                }
                for (size_t i = shared_bytes; i < b.shared.size(); ++i) {
                    if (b.shared[i] != 0xff) {
                        blockIdx = dim3(bx, by, bz);
                        fail("block wrote past its %zu bytes of dynamic shared memory (byte %zu)", shared_bytes, i);
                    }
                }
            }
        }
    }
    {
        std::lock_guard lk(gate.mu);
        gate.stop = true;
    }
    gate.start.notify_all();
    for (auto& t : pool) t.join();
}

}  // namespace cuda_emu

using cuda_emu::launch;
