// A CPU emulation of the little CUDA that worker/src/gpu/kernels.cu uses, so that the file
// compiles unchanged with g++ (include this header, then the .cu) and its kernels run on the
// CPU, faithfully enough to check their indexing, tiling, reductions and barriers.
//
// `launch(grid, block, shared_bytes, f)` runs the grid's blocks one after another; each block
// runs its CUDA threads as fibers (ucontext, one stack each) on the launching thread: a thread
// runs until it reaches a barrier (__syncthreads, a warp shuffle) or returns, then the next
// one runs, in an order shuffled on every pass (seeded, so a run is reproducible), and a
// barrier releases its waiters when the last of them arrives (that thread goes on at once).
// So a missing barrier, where one thread reads what another writes, shows up as a wrong or
// NaN result. A switch costs far less than waking an OS thread. Because only one block runs
// at a time, a function-local `static` is that block's shared memory (`__shared__` becomes
// `static`).
//
// It is strict where CUDA's rules are: the process fails with a message naming the kernel's
// source line, instead of passing, when
//   - a __syncthreads is reached by only some of the block's threads (the others exited),
//     or by threads at different __syncthreads calls, or can never complete (a deadlock,
//     e.g. threads waiting at a warp shuffle and at __syncthreads), or a launch runs over
//     kLaunchTimeout (a thread looping without reaching a barrier);
//   - a warp shuffle with the full mask runs in a partial warp, or with only some lanes;
//   - a launch breaks CUDA's limits (1024 threads a block, 48 KiB of shared memory);
//   - a kernel writes past the end of its dynamic shared memory (checked after each block;
//     the buffer starts as NaN, so reading memory no thread wrote shows up too).
//
// It does not emulate: the PTX or the compiler's code for it, real warp scheduling (lanes
// of a warp are independent threads here, synchronised only at shuffles), the GPU memory
// model (all threads see one coherent memory; barriers here are also full fences), atomics,
// or the driver's argument passing. One launch runs at a time (launcher.cpp holds a lock).
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
#include <utility>
#include <ucontext.h>
#include <sys/mman.h>
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

// How long one launch may run before the emulation calls it a hang (a thread that loops
// without reaching a barrier would otherwise never give the others a turn).
inline constexpr std::chrono::seconds kLaunchTimeout{60};
// Bytes of guard after the dynamic shared memory, checked after each block.
inline constexpr size_t kSharedGuard = 256;
// Each emulated thread's stack (plus a guard page below it).
inline constexpr size_t kFiberStack = 256 * 1024;

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

// One emulated CUDA thread of the running block.
struct Fiber {
    ucontext_t ctx;
    dim3 idx;
    bool done = false;
    // Parked at a barrier (which one, for the deadlock message).
    bool waiting = false;
    const char* waiting_at = nullptr;
    unsigned waiting_line = 0;
};

// The launching thread's context (fibers return to it) and the fiber that is running.
inline ucontext_t scheduler_ctx;
inline Fiber* running = nullptr;

// A barrier over `count` threads that knows which threads have exited the kernel, so that a
// barrier only some threads can reach fails at once instead of hanging, and that checks every
// thread of a phase arrived from the same call site.
class Barrier {
public:
    Barrier(unsigned count, const char* what) : count_(count), what_(what) {}

    void arrive_and_wait(const std::source_location& loc) {
        if (arrived_ == 0) {
            site_ = loc;
        } else if (site_.line() != loc.line() || std::strcmp(site_.file_name(), loc.file_name()) != 0) {
            fail("divergent %s: threads of one phase reached it at line %u and at line %u", what_,
                 (unsigned)site_.line(), (unsigned)loc.line());
        }
        ++arrived_;
        check_reachable();
        if (arrived_ == count_) {
            // The last to arrive releases the others and goes on first.
            arrived_ = 0;
            for (Fiber* f : waiters_) f->waiting = false;
            waiters_.clear();
            return;
        }
        Fiber* self = running;
        self->waiting = true;
        self->waiting_at = what_;
        self->waiting_line = (unsigned)loc.line();
        waiters_.push_back(self);
        swapcontext(&self->ctx, &scheduler_ctx);
    }

    // The calling thread returned from the kernel.
    void thread_exited() {
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

    unsigned count_;
    const char* what_;
    unsigned arrived_ = 0;
    unsigned exited_ = 0;
    std::vector<Fiber*> waiters_;
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

// Fiber stacks, each with a PROT_NONE guard page below it (an overflow faults instead of
// corrupting the neighbour), kept for the next launch.
struct Stacks {
    ~Stacks() {
        for (char* b : bases) munmap(b - 4096, kFiberStack + 4096);
    }
    std::vector<char*> bases;
    char* get(unsigned i) {
        while (bases.size() <= i) {
            void* p = mmap(nullptr, kFiberStack + 4096, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) fail("mmap of a fiber stack failed");
            if (mprotect(p, 4096, PROT_NONE) != 0) fail("mprotect of a fiber stack's guard page failed");
            bases.push_back(static_cast<char*>(p) + 4096);
        }
        return bases[i];
    }
};
inline Stacks stacks;

// The running launch's kernel, type-erased for the fibers' entry point.
inline void (*entry_fn)(void*) = nullptr;
inline void* entry_arg = nullptr;

inline void fiber_main() {
    entry_fn(entry_arg);
    running->done = true;
    current->bar.thread_exited();
    current->warps[linear_tid() / 32]->bar.thread_exited();
    // Returning resumes scheduler_ctx (uc_link).
}

// Points `f` at the start of fiber_main on `stack`. Out of line: getcontext may return twice
// as far as the compiler knows, which must not touch the caller's locals.
[[gnu::noinline]] inline void prepare(Fiber& f, char* stack) {
    if (getcontext(&f.ctx) != 0) fail("getcontext failed");
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = &scheduler_ctx;
    makecontext(&f.ctx, fiber_main, 0);
}

// Fails the process if the launch it guards runs over kLaunchTimeout.
class Watchdog {
public:
    Watchdog() : thread_([this] {
        std::unique_lock lk(mu_);
        if (!cv_.wait_for(lk, kLaunchTimeout, [&] { return over_; })) {
            std::fprintf(stderr, "CUDA EMULATION ERROR: a launch ran over %lld s (a thread loops without "
                                 "reaching a barrier?)\n", (long long)kLaunchTimeout.count());
            std::fflush(stderr);
            std::_Exit(3);
        }
    }) {}
    ~Watchdog() {
        {
            std::lock_guard lk(mu_);
            over_ = true;
        }
        cv_.notify_one();
        thread_.join();
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool over_ = false;
    std::thread thread_;
};

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
    Watchdog watchdog;
    entry_fn = [](void* k) { (*static_cast<std::remove_reference_t<F>*>(k))(); };
    entry_arg = static_cast<void*>(&kernel);
    std::vector<Fiber> fibers(threads);
    std::vector<unsigned> order(threads);
    for (unsigned i = 0; i < threads; ++i) order[i] = i;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (unsigned tz = 0, i = 0; tz < block.z; ++tz) {
        for (unsigned ty = 0; ty < block.y; ++ty) {
            for (unsigned tx = 0; tx < block.x; ++tx) fibers[i++].idx = dim3(tx, ty, tz);
        }
    }
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block b(threads, shared_bytes);
                current = &b;
                blockIdx = dim3(bx, by, bz);
                for (unsigned i = 0; i < threads; ++i) {
                    Fiber& f = fibers[i];
                    f.done = false;
                    f.waiting = false;
                    prepare(f, stacks.get(i));
                }
                // Passes over the threads that can run, until every one has returned, each pass
                // in another (seeded, so reproducible) order: a thread that reads what another
                // writes without a barrier between them then reads it too early in some pass.
                unsigned finished = 0;
                while (finished < threads) {
                    bool ran = false;
                    for (unsigned k = threads - 1; k > 0; --k) {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        std::swap(order[k], order[rng % (k + 1)]);
                    }
                    for (unsigned i : order) {
                        Fiber& f = fibers[i];
                        if (f.done || f.waiting) continue;
                        running = &f;
                        threadIdx = f.idx;
                        if (swapcontext(&scheduler_ctx, &f.ctx) != 0) fail("swapcontext failed");
                        running = nullptr;
                        ran = true;
                        if (f.done) ++finished;
                    }
                    if (!ran) {
                        // Everyone left is parked at a barrier that nobody else can reach.
                        unsigned waiting = 0;
                        const Fiber* first = nullptr;
                        for (const Fiber& f : fibers) {
                            if (f.waiting) {
                                ++waiting;
                                if (!first) first = &f;
                            }
                        }
                        threadIdx = first->idx;
                        fail("deadlock: %u of %u threads wait at barriers that cannot complete (this one at "
                             "%s, line %u)",
                             waiting, threads, first->waiting_at, first->waiting_line);
                    }
                }
                current = nullptr;
                for (size_t i = shared_bytes; i < b.shared.size(); ++i) {
                    if (b.shared[i] != 0xff) {
                        fail("block wrote past its %zu bytes of dynamic shared memory (byte %zu)", shared_bytes, i);
                    }
                }
            }
        }
    }
    entry_fn = nullptr;
    entry_arg = nullptr;
}

}  // namespace cuda_emu

using cuda_emu::launch;
