//! The GPU path's CUDA kernels (`src/gpu/kernels.cu`), run on the CPU against naive reference
//! loops, on every machine (no GPU, no CUDA toolkit, no cargo feature).
//!
//! `tests/emu/cuda_emu.h` lets g++ compile `kernels.cu` unchanged: each CUDA block runs with
//! one fiber per CUDA thread, `__syncthreads` and warp shuffles are real barriers (threads run
//! in a shuffled order between them, so a missing barrier gives wrong results), and
//! `tests/emu/check_kernels.cpp` launches every kernel (embed, rms_norm, matmul_nt, gemv_nt,
//! rope, kv_write, attention, silu_mul) with the grid, block and shared-memory sizes of
//! `src/gpu/mod.rs`, on seeded inputs with edge shapes, and compares with plain loops.
//!
//! What this verifies: the kernels' indexing (activations, weights, the paged KV pool and its
//! block table), tiling and partial tiles, block and warp reductions, the placement of their
//! barriers (a `__syncthreads` that only some threads reach fails the run instead of passing),
//! and attention's online softmax over several key tiles, on the CPU.
//!
//! What it does not: the PTX NVRTC makes of the file (`kernels.ptx`, checked by the `cuda`
//! feature's tests), the driver, real warp scheduling and the GPU memory model (the emulated
//! threads share one coherent memory), and the Rust launch code's argument passing (the sizes
//! here are copied from `mod.rs` by hand). Those need a GPU: `tests/gpu.rs`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kvtier_testkit::process::run_bounded;

/// Bounds compiling and running the emulation; both take a few seconds.
const LIMIT: Duration = Duration::from_secs(120);

/// Runs `cmd`, killing it after [`LIMIT`]; returns whether it succeeded and its output
/// (stdout, then stderr).
fn run(cmd: &mut Command, what: &str) -> Result<(bool, String)> {
    let f = run_bounded(cmd, LIMIT).with_context(|| format!("{what} (a kernel deadlocked?)"))?;
    Ok((f.status.success(), f.output()))
}

/// Builds `tests/emu/check_kernels.cpp` over `kernels` (the text of a `kernels.cu`) in `dir`,
/// laid out as in the repository so its relative includes resolve, and runs it: whether it
/// passed, and its output.
fn build_and_run(dir: &Path, kernels: &str) -> Result<(bool, String)> {
    let emu = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emu");
    let (tests, src) = (dir.join("worker/tests/emu"), dir.join("worker/src/gpu"));
    std::fs::create_dir_all(&tests)?;
    std::fs::create_dir_all(&src)?;
    for f in ["cuda_emu.h", "check_kernels.cpp"] {
        std::fs::copy(emu.join(f), tests.join(f))?;
    }
    std::fs::write(src.join("kernels.cu"), kernels)?;
    let exe = dir.join("check_kernels");
    let mut gxx = Command::new("g++");
    gxx.args(["-std=c++20", "-O2", "-pthread", "-Wall", "-Wextra", "-o"])
        .arg(&exe)
        .arg(tests.join("check_kernels.cpp"));
    let (ok, text) = match run(&mut gxx, "g++") {
        Ok(r) => r,
        Err(e) => {
            return Err(e.context(
                "this test needs g++ (C++20) on PATH to build the CPU emulation of the CUDA kernels",
            ));
        }
    };
    ensure!(
        ok,
        "g++ failed to build tests/emu/check_kernels.cpp:\n{text}"
    );
    run(&mut Command::new(&exe), "check_kernels")
}

fn kernels_source() -> Result<String> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/gpu/kernels.cu");
    std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
}

#[test]
fn cuda_kernels_match_reference_loops_on_the_cpu() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    let (ok, text) = build_and_run(dir.path(), &kernels_source()?)?;
    println!("{text}");
    println!("emulated kernels built and ran in {:?}", started.elapsed());
    ensure!(
        ok,
        "a kernel disagrees with its reference (or broke CUDA's rules):\n{text}"
    );
    for kernel in [
        "embed",
        "rms_norm",
        "matmul_nt",
        "gemv_nt",
        "rope",
        "kv_write",
        "attention",
        "silu_mul",
    ] {
        ensure!(
            text.lines()
                .any(|l| l.starts_with(&format!("ok {kernel} "))),
            "no check of kernel {kernel} in the output:\n{text}"
        );
    }
    ensure!(
        text.lines().any(|l| l == "all kernels ok"),
        "the emulation did not finish:\n{text}"
    );
    Ok(())
}

/// The emulation is strict enough to be worth passing: kernels with a barrier bug injected
/// fail it. A missing barrier between one thread's write to shared memory and the others'
/// reads (it shows only because threads run in a shuffled order), a barrier only some threads
/// reach, and a warp shuffle only some lanes reach.
#[test]
fn the_emulation_catches_barrier_bugs() -> Result<()> {
    let good = kernels_source()?;
    let mutants = [
        (
            "attention without the barrier after thread 0's softmax",
            "            corr_sh = corr;\n        }\n        __syncthreads();\n",
            "            corr_sh = corr;\n        }\n",
            "FAIL attention",
        ),
        (
            "block_sum with a barrier only the first warp reaches",
            "    if (lane == 0) scratch[warp] = v;\n    __syncthreads();\n",
            "    if (lane == 0) scratch[warp] = v;\n    if (threadIdx.x < 32) __syncthreads();\n",
            "CUDA EMULATION ERROR: divergent __syncthreads",
        ),
        (
            "gemv_nt with a shuffle half of each warp skips",
            "acc += __shfl_down_sync(0xffffffffu, acc, o);",
            "if (lane < 16) acc += __shfl_down_sync(0xffffffffu, acc, o);",
            "CUDA EMULATION ERROR: __shfl_down_sync",
        ),
    ];
    for (what, from, to, want) in mutants {
        ensure!(
            good.matches(from).count() == 1,
            "{what}: kernels.cu changed; update the mutant (expected the text once: {from:?})"
        );
        let dir = tempfile::tempdir()?;
        let (ok, text) = build_and_run(dir.path(), &good.replacen(from, to, 1))?;
        ensure!(!ok, "{what}: the emulation passed it:\n{text}");
        ensure!(
            text.contains(want),
            "{what}: failed, but without {want:?}:\n{text}"
        );
    }
    Ok(())
}
