//! The GPU path (feature `cuda`) against the CPU forward: logits, the KV bytes in the pool,
//! prefix blocks loaded into GPU memory, generation, and serving with a kvtier sidecar.
//!
//! Every check runs on two backends of the same host code (`worker/src/gpu`):
//! * **the emulator**, always: `kernels.cu` built by g++ with the CPU emulation of CUDA in
//!   `tests/emu/` into a shared library that `Gpu::emulated` loads, so allocation, copies,
//!   launch shapes and arguments, and the kernels run unchanged on the CPU (one fiber per
//!   CUDA thread; far slower than a GPU, so these runs use a smaller model and shorter
//!   prompts);
//! * **a real GPU**, where one exists (the default model, longer prompts). Elsewhere those runs
//!   print `SKIPPED ...`, and fail instead when `KVTIER_REQUIRE_GPU=1` (`.ci/gpu-check`).
//!
//! What only a real GPU shows: the PTX (NVRTC's output, loaded and JIT-compiled by the driver),
//! the driver calls, and the GPU's own execution and memory model.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_testkit::process::run_bounded;
use kvtier_worker::gpu::Gpu;
use kvtier_worker::serve::{Role, ServeConfig, WorkerServer};
use kvtier_worker::{
    BlockTable, ByteTokenizer, DeviceSpec, Engine, FinishReason, Model, ModelConfig, PagedKvCache,
    Sampling,
};
use serde_json::json;

/// Logits agree within this, relative to the largest CPU logit (at least 1): the kernels sum in
/// another order than candle's CPU matmul (and a GPU fuses multiply-adds).
const LOGIT_TOL: f32 = 2e-3;
/// KV values agree within this, relative to the value (at least 1).
const KV_TOL: f32 = 1e-4;

/// One backend under test, with the model shape and prompt lengths it can afford.
struct Case {
    gpu: Arc<Gpu>,
    cfg: ModelConfig,
    /// Prompt lengths for the logits check (1 token, a partial block, several attention
    /// tiles, and for a real GPU a long prompt).
    lengths: &'static [usize],
    /// (first chunk, total) for the chunked-prefill check.
    chunked: (usize, usize),
    /// Tokens to generate in the greedy and serving checks.
    generate: usize,
}

/// A small model for the emulator (the emulation runs every CUDA thread, one after another). Its KV
/// layout (2 KV heads x 32, 16-token blocks, f32) is what `common::kvtier_config` serves.
fn small_config() -> ModelConfig {
    ModelConfig {
        hidden_size: 128,
        intermediate_size: 160,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        ..ModelConfig::default()
    }
}

/// Builds `tests/emu/launcher.cpp` once per test run (into cargo's per-target temporary
/// directory), bounded in time.
fn emulator_library() -> Result<PathBuf> {
    static LIB: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(|| build_emulator().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

fn build_emulator() -> Result<PathBuf> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emu/launcher.cpp");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("libkvtier-gpu-emu-{}.so", std::process::id()));
    let o = run_bounded(
        Command::new("g++")
            .args(["-std=c++20", "-O2", "-pthread", "-shared", "-fPIC", "-o"])
            .arg(&out)
            .arg(&src),
        Duration::from_secs(180),
    )
    .context("this test needs g++ (C++20) on PATH to build the CUDA emulator")?;
    ensure!(
        o.status.success(),
        "g++ failed on {}:\n{}",
        src.display(),
        o.stderr
    );
    Ok(out)
}

fn emulated() -> Result<Case> {
    let lib = emulator_library()?;
    // SAFETY: the library was just built from tests/emu/launcher.cpp, which exports
    // kvtier_emu_launch with the signature Gpu::emulated calls.
    let gpu = unsafe { Gpu::emulated(&lib) }?;
    Ok(Case {
        gpu,
        cfg: small_config(),
        lengths: &[17, 70],
        chunked: (40, 90),
        generate: 4,
    })
}

/// The real GPU, or None with a SKIPPED line (a failure under KVTIER_REQUIRE_GPU=1).
fn real_gpu(test: &str) -> Result<Option<Case>> {
    if let Err(e) = kvtier_worker::gpu::probe() {
        ensure!(
            std::env::var_os("KVTIER_REQUIRE_GPU").is_none(),
            "KVTIER_REQUIRE_GPU is set but {e}"
        );
        eprintln!("SKIPPED {test} on a real GPU (it runs on the emulator only): {e}");
        return Ok(None);
    }
    Ok(Some(Case {
        gpu: Gpu::open(0)?,
        cfg: ModelConfig::default(),
        lengths: &[1, 17, 100, 700],
        chunked: (300, 450),
        generate: 16,
    }))
}

/// The emulator runs one launch at a time: the tests take turns, so that the serving test's
/// HTTP deadlines do not run out while another test holds the emulator.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The emulator, then the real GPU where there is one.
fn cases(test: &str) -> Result<Vec<Case>> {
    let mut v = vec![emulated()?];
    v.extend(real_gpu(test)?);
    Ok(v)
}

impl Case {
    fn models(&self, seed: u64) -> Result<(Model, Model)> {
        Ok((
            Model::random(self.cfg.clone(), seed)?,
            Model::random(self.cfg.clone(), seed)?.to_gpu(&self.gpu)?,
        ))
    }
}

/// Deterministic pseudo-text token ids below the byte vocabulary.
fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 7) % 256)
        .collect()
}

fn assert_logits_close(cpu: &[f32], gpu: &[f32], what: &str) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: vocab");
    let scale = cpu.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let (i, diff) = cpu
        .iter()
        .zip(gpu)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold(
            (0, 0.0f32),
            |best, (i, d)| if d > best.1 { (i, d) } else { best },
        );
    assert!(
        diff <= LOGIT_TOL * scale && gpu.iter().all(|x| x.is_finite()),
        "{what}: logit {i} differs by {diff} (cpu {}, gpu {}; bound {})",
        cpu[i],
        gpu[i],
        LOGIT_TOL * scale
    );
}

fn assert_blocks_close(
    cpu: &PagedKvCache,
    gpu: &PagedKvCache,
    ct: &BlockTable,
    gt: &BlockTable,
    what: &str,
) {
    assert_eq!(ct.len(), gt.len(), "{what}: blocks");
    for (i, (c, g)) in ct.blocks().iter().zip(gt.blocks()).enumerate() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        cpu.read_block(*c, &mut a).unwrap();
        gpu.read_block(*g, &mut b).unwrap();
        let f = |v: &[u8]| -> Vec<f32> {
            v.chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect()
        };
        for (j, (x, y)) in f(&a).iter().zip(f(&b)).enumerate() {
            assert!(
                (x - y).abs() <= KV_TOL * x.abs().max(1.0),
                "{what}: block {i}, value {j}: cpu {x}, gpu {y}"
            );
        }
    }
}

#[test]
fn gpu_logits_and_kv_match_the_cpu_for_prompts_chunks_and_decode_steps() -> Result<()> {
    let _turn = serial();
    for case in cases("gpu_logits_and_kv_match_the_cpu")? {
        let on = case.gpu.label().to_owned();
        let (cpu_model, gpu_model) = case.models(7)?;
        let mut cpu = Engine::new(cpu_model, 128)?;
        let mut gpu = Engine::new(gpu_model, 128)?;
        ensure!(gpu.cache().is_on_gpu(), "{on}: the pool is in GPU memory");
        for (i, &n) in case.lengths.iter().enumerate() {
            let p = tokens(n, i as u32 + 1);
            let (mut ct, mut gt) = (BlockTable::new(), BlockTable::new());
            let a = cpu.prefill(&p, 0, &mut ct)?;
            let b = gpu.prefill(&p, 0, &mut gt)?;
            assert_logits_close(&a, &b, &format!("{on}: prefill of {n} tokens"));
            assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt, &on);
            // Decode steps on top (the one-row GEMV path).
            let mut a = a;
            for step in 0..2 {
                let next = kvtier_worker::model::argmax(&a);
                a = cpu.decode_step(next, n + step, &mut ct)?;
                let b = gpu.decode_step(next, n + step, &mut gt)?;
                assert_logits_close(&a, &b, &format!("{on}: decode step {step} after {n}"));
            }
            assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt, &on);
            cpu.cache_mut().release_table(&mut ct)?;
            gpu.cache_mut().release_table(&mut gt)?;
        }
        // Chunked prefill (as the scheduler does): the second chunk starts past the first,
        // reading the first's KV from the pool; equals the CPU running everything at once.
        let (first, total) = case.chunked;
        let p = tokens(total, 9);
        let (mut ct, mut gt) = (BlockTable::new(), BlockTable::new());
        let a = cpu.prefill(&p, 0, &mut ct)?;
        gpu.prefill(&p[..first], 0, &mut gt)?;
        let b = gpu.prefill(&p, first, &mut gt)?;
        assert_logits_close(&a, &b, &format!("{on}: chunked prefill"));
        assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt, &on);
    }
    Ok(())
}

#[test]
fn a_prefix_loaded_into_gpu_memory_equals_computing_it() -> Result<()> {
    let _turn = serial();
    for case in cases("a_prefix_loaded_into_gpu_memory_equals_computing_it")? {
        let on = case.gpu.label().to_owned();
        let (cpu_model, gpu_model) = case.models(11)?;
        let mut cpu = Engine::new(cpu_model, 64)?;
        let mut gpu = Engine::new(gpu_model, 64)?;
        let p = tokens(64 + 20, 5);
        // The CPU computes the whole prompt; its first 4 blocks (64 tokens) are what kvtier
        // would hand back as raw bytes. The GPU pool gets them in other block ids.
        let mut ct = BlockTable::new();
        let want = cpu.prefill(&p, 0, &mut ct)?;
        let mut gt = BlockTable::new();
        let spare = gpu.cache_mut().allocate()?;
        gpu.cache_mut().reserve(&mut gt, 64)?;
        for (c, g) in ct.blocks()[..4].iter().zip(gt.clone().blocks()) {
            let mut bytes = Vec::new();
            cpu.cache().read_block(*c, &mut bytes)?;
            gpu.cache_mut().write_block(*g, &bytes)?;
        }
        gpu.cache_mut().release(spare)?;
        let got = gpu.prefill(&p, 64, &mut gt)?;
        assert_logits_close(
            &want,
            &got,
            &format!("{on}: after a loaded 64-token prefix"),
        );
        assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt, &on);
    }
    Ok(())
}

#[test]
fn greedy_generation_on_the_gpu_equals_the_cpu() -> Result<()> {
    let _turn = serial();
    for case in cases("greedy_generation_on_the_gpu_equals_the_cpu")? {
        let (cpu_model, gpu_model) = case.models(0)?;
        let prompt = ByteTokenizer.encode("kvtier keeps the prefix; the GPU runs the rest.", true);
        let a = Engine::new(cpu_model, 64)?.generate(&prompt, case.generate, Sampling::GREEDY)?;
        let b = Engine::new(gpu_model, 64)?.generate(&prompt, case.generate, Sampling::GREEDY)?;
        assert_eq!(a.tokens, b.tokens, "{}: greedy tokens", case.gpu.label());
        assert_eq!(a.finish, b.finish);
    }
    Ok(())
}

#[test]
fn serving_on_the_gpu_with_a_sidecar_reuses_the_prefix() -> Result<()> {
    let _turn = serial();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(serve_twice())
}

async fn serve_twice() -> Result<()> {
    for case in cases("serving_on_the_gpu_with_a_sidecar_reuses_the_prefix")? {
        let on = case.gpu.label().to_owned();
        let prompt = "The GPU worker stores its prompt blocks in kvtier and loads them next turn.";
        let ids = ByteTokenizer.encode(prompt, true);
        let g = Engine::new(Model::random(case.cfg.clone(), 0)?, 64)?.generate(
            &ids,
            case.generate,
            Sampling::GREEDY,
        )?;
        let want = ByteTokenizer.decode(&g.tokens)?;
        let dir = tempfile::tempdir()?;
        let kv = kvtier_config(dir.path(), "8MiB", case.cfg.num_layers as u32)?;
        let (server, unix, _tcp) = start_kvtier(&kv).await?;
        let w = WorkerServer::start(ServeConfig {
            model_config: case.cfg.clone(),
            gpu: Some(case.gpu.clone()),
            pool_blocks: 64,
            // The second turn must come from the sidecar, not the pool's own prefix cache.
            prefix_cache: false,
            ..worker_config(Some(unix))
        })
        .await?;
        let prompt_blocks = ids.len() / 16;
        // The answer's blocks are stored too when the sequence ends (positions with KV).
        let fed = g.tokens.len() - usize::from(g.finish == FinishReason::MaxTokens);
        let all_blocks = (ids.len() + fed) / 16;
        let mut cached = Vec::new();
        for turn in 0..2 {
            let r = post(
                w.addr(),
                "/v1/completions",
                &json!({"model": "kvtier-tiny", "prompt": prompt,
                        "max_tokens": case.generate, "temperature": 0}),
            )
            .await?;
            ensure!(r.status == 200, "{on}: status {}: {}", r.status, r.body);
            let v = r.json()?;
            let text = v["choices"][0]["text"].as_str().context("text")?;
            assert_eq!(text, want, "{on}, turn {turn}: the CPU reference");
            cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
            if turn == 0 {
                let m = w.metrics().clone();
                wait_for(Duration::from_secs(60), || {
                    m.blocks_stored.get() >= all_blocks as u64
                })
                .await?;
            }
        }
        assert_eq!(
            cached,
            [Some(0), Some(prompt_blocks as u64 * 16)],
            "{on}: the second turn loads the prompt's blocks into GPU memory"
        );
        w.shutdown().await;
        server.shutdown().await;
    }
    Ok(())
}

/// Settings that cannot work are refused before any GPU is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_worker_refuses_the_disaggregated_roles() -> Result<()> {
    for role in [Role::Prefill, Role::Decode] {
        let err = WorkerServer::start(ServeConfig {
            device: DeviceSpec::Cuda(0),
            role,
            prefill_url: (role == Role::Decode).then(|| "http://127.0.0.1:1".to_owned()),
            ..worker_config(None)
        })
        .await
        .err()
        .context("a GPU worker with a disaggregated role started")?;
        let msg = err.to_string();
        assert!(msg.contains("device") && msg.contains("role both"), "{msg}");
    }
    Ok(())
}

/// A GPU model with a host pool, or the reverse, is refused, not run.
#[test]
fn an_engine_refuses_a_pool_on_the_wrong_device() -> Result<()> {
    let _turn = serial();
    let case = emulated()?;
    let layout = case.cfg.kv_layout()?;
    let (cpu, gpu) = case.models(0)?;
    assert!(!cpu.on_gpu() && gpu.on_gpu());
    assert_eq!(gpu.device_label(), "emulated");
    let host = PagedKvCache::new(layout, 4)?;
    let dev = PagedKvCache::on_gpu(layout, 4, &case.gpu)?;
    assert!(Engine::with_cache(gpu, host).is_err());
    assert!(Engine::with_cache(cpu, dev).is_err());
    // A pool on another opening of the emulator: another GPU, as far as the model knows.
    let (_, gpu) = case.models(0)?;
    let other = emulated()?;
    let dev = PagedKvCache::on_gpu(layout, 4, &other.gpu)?;
    let e = Engine::with_cache(gpu, dev)
        .err()
        .context("accepted")?
        .to_string();
    assert!(e.contains("another GPU"), "{e}");
    Ok(())
}
