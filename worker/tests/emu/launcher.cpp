// kernels.cu under the CPU emulation of CUDA (cuda_emu.h), as a shared library with one C
// entry point shaped like cuLaunchKernel: a kernel's name, grid, block, dynamic shared-memory
// bytes and an array of pointers to the argument values. kvtier-worker's GPU path loads it
// with `Gpu::emulated`, so its host code (allocations, copies, launch shapes and arguments)
// runs unchanged on the CPU; "device" addresses are host addresses there.
// Built by worker/tests/gpu.rs: g++ -std=c++20 -O2 -pthread -shared -fPIC.
#include "cuda_emu.h"

#include "../../src/gpu/kernels.cu"

#include <cstring>
#include <mutex>

namespace {

template <class T>
T arg(void** params, int i) {
    T v;
    std::memcpy(&v, params[i], sizeof(T));
    return v;
}

// The emulator keeps the running launch in globals: one launch at a time.
std::mutex launch_mutex;

}  // namespace

extern "C" int kvtier_emu_launch(const char* name, const unsigned* g, const unsigned* b, unsigned shared,
                                 void** p) {
    std::lock_guard<std::mutex> lock(launch_mutex);
    dim3 grid(g[0], g[1], g[2]), block(b[0], b[1], b[2]);
    auto run = [&](auto&& kernel) {
        launch(grid, block, shared, kernel);
        return 0;
    };
    using cf = const float*;
    using f = float*;
    using cu = const unsigned int*;
    using ll = long long;
    if (!std::strcmp(name, "embed"))
        return run([&] { embed(arg<cu>(p, 0), arg<cf>(p, 1), arg<f>(p, 2), arg<int>(p, 3)); });
    if (!std::strcmp(name, "rms_norm"))
        return run([&] { rms_norm(arg<cf>(p, 0), arg<cf>(p, 1), arg<f>(p, 2), arg<int>(p, 3), arg<float>(p, 4)); });
    if (!std::strcmp(name, "matmul_nt"))
        return run([&] {
            matmul_nt(arg<cf>(p, 0), arg<cf>(p, 1), arg<f>(p, 2), arg<int>(p, 3), arg<int>(p, 4), arg<int>(p, 5),
                      arg<int>(p, 6));
        });
    if (!std::strcmp(name, "gemv_nt"))
        return run([&] {
            gemv_nt(arg<cf>(p, 0), arg<cf>(p, 1), arg<f>(p, 2), arg<int>(p, 3), arg<int>(p, 4), arg<int>(p, 5));
        });
    if (!std::strcmp(name, "rope"))
        return run([&] {
            rope(arg<f>(p, 0), arg<cf>(p, 1), arg<cf>(p, 2), arg<int>(p, 3), arg<int>(p, 4), arg<int>(p, 5));
        });
    if (!std::strcmp(name, "kv_write"))
        return run([&] {
            kv_write(arg<cf>(p, 0), arg<cf>(p, 1), arg<f>(p, 2), arg<cu>(p, 3), arg<int>(p, 4), arg<int>(p, 5),
                     arg<int>(p, 6), arg<int>(p, 7), arg<int>(p, 8), arg<ll>(p, 9));
        });
    if (!std::strcmp(name, "attention"))
        return run([&] {
            attention(arg<cf>(p, 0), arg<cf>(p, 1), arg<cu>(p, 2), arg<f>(p, 3), arg<int>(p, 4), arg<int>(p, 5),
                      arg<int>(p, 6), arg<int>(p, 7), arg<int>(p, 8), arg<int>(p, 9), arg<ll>(p, 10),
                      arg<float>(p, 11));
        });
    if (!std::strcmp(name, "silu_mul"))
        return run([&] { silu_mul(arg<f>(p, 0), arg<cf>(p, 1), arg<ll>(p, 2)); });
    std::fprintf(stderr, "kvtier_emu_launch: unknown kernel %s\n", name);
    return 1;
}
