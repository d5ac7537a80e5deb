//! The GPU path's CUDA kernels (`src/gpu/kernels.cu`), run on the CPU against naive reference
//! loops, on every machine (no GPU, no CUDA toolkit, no cargo feature).
//!
//! `tests/emu/cuda_emu.h` lets g++ compile `kernels.cu` unchanged: each CUDA block runs with
//! one real thread per CUDA thread, `__syncthreads` and warp shuffles are real barriers, and
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

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

/// Bounds compiling and running the emulation; both take a few seconds.
const LIMIT: Duration = Duration::from_secs(120);

/// Runs `cmd` with stdout and stderr to files in `dir`, killing it after `limit`; returns
/// whether it succeeded and its output.
fn run_bounded(
    mut cmd: Command,
    dir: &Path,
    what: &str,
    limit: Duration,
) -> Result<(bool, String)> {
    let out_path = dir.join(format!("{what}.out"));
    let out = File::create(&out_path)?;
    let err = out.try_clone()?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            child.kill()?;
            child.wait()?;
            let text = std::fs::read_to_string(&out_path).unwrap_or_default();
            bail!("{what} still running after {limit:?} (a kernel deadlocked?); output:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&out_path)?;
    Ok((status.success(), text))
}

#[test]
fn cuda_kernels_match_reference_loops_on_the_cpu() -> Result<()> {
    let emu = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emu");
    let dir = tempfile::tempdir()?;
    let exe = dir.path().join("check_kernels");

    let mut gxx = Command::new("g++");
    gxx.args(["-std=c++20", "-O2", "-pthread", "-Wall", "-Wextra", "-o"])
        .arg(&exe)
        .arg(emu.join("check_kernels.cpp"));
    let (ok, text) = match run_bounded(gxx, dir.path(), "g++", LIMIT) {
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

    let started = Instant::now();
    let (ok, text) = run_bounded(Command::new(&exe), dir.path(), "check_kernels", LIMIT)?;
    println!("{text}");
    println!("emulated kernels ran in {:?}", started.elapsed());
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
