//! The GPU path (feature `cuda`) against the CPU forward: logits, the KV bytes in the pool,
//! prefix blocks loaded into GPU memory, generation, and serving with a kvtier sidecar.
//!
//! Tests that need a GPU print `SKIPPED ...` where there is none (and fail instead when
//! `KVTIER_REQUIRE_GPU=1`, for runs on a GPU machine). The settings checks run everywhere.
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_worker::serve::{Role, ServeConfig, WorkerServer};
use kvtier_worker::{
    BlockTable, ByteTokenizer, DeviceSpec, Engine, Model, ModelConfig, PagedKvCache, Sampling,
};
use serde_json::json;

/// Logits agree within this, relative to the largest CPU logit (at least 1): the GPU kernels
/// sum in another order than candle's CPU matmul, and fuse multiply-adds.
const LOGIT_TOL: f32 = 2e-3;
/// KV values agree within this, relative to the value (at least 1).
const KV_TOL: f32 = 1e-4;

fn have_gpu(test: &str) -> bool {
    match kvtier_worker::gpu::probe() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var_os("KVTIER_REQUIRE_GPU").is_none(),
                "KVTIER_REQUIRE_GPU is set but {e}"
            );
            eprintln!("SKIPPED {test}: {e}");
            false
        }
    }
}

fn models(seed: u64) -> Result<(Model, Model)> {
    let cfg = ModelConfig::default();
    Ok((
        Model::random(cfg.clone(), seed)?,
        Model::random(cfg, seed)?.to_device(DeviceSpec::Cuda(0))?,
    ))
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

fn assert_blocks_close(cpu: &PagedKvCache, gpu: &PagedKvCache, ct: &BlockTable, gt: &BlockTable) {
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
                "block {i}, value {j}: cpu {x}, gpu {y}"
            );
        }
    }
}

#[test]
fn gpu_logits_and_kv_match_the_cpu_for_prompts_chunks_and_decode_steps() -> Result<()> {
    if !have_gpu("gpu_logits_and_kv_match_the_cpu") {
        return Ok(());
    }
    let (cpu_model, gpu_model) = models(7)?;
    let mut cpu = Engine::new(cpu_model, 128)?;
    let mut gpu = Engine::new(gpu_model, 128)?;
    ensure!(
        gpu.cache().is_on_gpu(),
        "the GPU engine's pool is in GPU memory"
    );
    // One token, a partial block, more keys than one attention tile, and a long prompt with
    // rows that are not a multiple of the matmul tile.
    for (n, salt) in [(1, 1), (17, 2), (100, 3), (700, 4)] {
        let p = tokens(n, salt);
        let (mut ct, mut gt) = (BlockTable::new(), BlockTable::new());
        let a = cpu.prefill(&p, 0, &mut ct)?;
        let b = gpu.prefill(&p, 0, &mut gt)?;
        assert_logits_close(&a, &b, &format!("prefill of {n} tokens"));
        assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt);
        // Decode steps on top.
        let mut a = a;
        for step in 0..4 {
            let next = kvtier_worker::model::argmax(&a);
            a = cpu.decode_step(next, n + step, &mut ct)?;
            let b = gpu.decode_step(next, n + step, &mut gt)?;
            assert_logits_close(&a, &b, &format!("decode step {step} after {n} tokens"));
        }
        assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt);
        cpu.cache_mut().release_table(&mut ct)?;
        gpu.cache_mut().release_table(&mut gt)?;
    }
    // Chunked prefill (the scheduler's 512-token chunks): 300 tokens, then 150 more from
    // position 300, equals the CPU running all 450 at once.
    let p = tokens(450, 9);
    let (mut ct, mut gt) = (BlockTable::new(), BlockTable::new());
    let a = cpu.prefill(&p, 0, &mut ct)?;
    gpu.prefill(&p[..300], 0, &mut gt)?;
    let b = gpu.prefill(&p, 300, &mut gt)?;
    assert_logits_close(&a, &b, "chunked prefill");
    assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt);
    Ok(())
}

#[test]
fn a_prefix_loaded_into_gpu_memory_equals_computing_it() -> Result<()> {
    if !have_gpu("a_prefix_loaded_into_gpu_memory_equals_computing_it") {
        return Ok(());
    }
    let (cpu_model, gpu_model) = models(11)?;
    let mut cpu = Engine::new(cpu_model, 64)?;
    let mut gpu = Engine::new(gpu_model, 64)?;
    let p = tokens(64 + 20, 5);
    // The CPU computes the whole prompt; its first 4 blocks (64 tokens) are what kvtier would
    // hand back as raw bytes.
    let mut ct = BlockTable::new();
    let want = cpu.prefill(&p, 0, &mut ct)?;
    let mut gt = BlockTable::new();
    gpu.cache_mut().reserve(&mut gt, 64)?;
    for (c, g) in ct.blocks()[..4].iter().zip(gt.clone().blocks()) {
        let mut bytes = Vec::new();
        cpu.cache().read_block(*c, &mut bytes)?;
        gpu.cache_mut().write_block(*g, &bytes)?;
    }
    let got = gpu.prefill(&p, 64, &mut gt)?;
    assert_logits_close(&want, &got, "prefill after a loaded 64-token prefix");
    assert_blocks_close(cpu.cache(), gpu.cache(), &ct, &gt);
    Ok(())
}

#[test]
fn greedy_generation_on_the_gpu_equals_the_cpu() -> Result<()> {
    if !have_gpu("greedy_generation_on_the_gpu_equals_the_cpu") {
        return Ok(());
    }
    let (cpu_model, gpu_model) = models(0)?;
    let prompt = ByteTokenizer.encode("kvtier keeps the prefix; the GPU computes the rest.", true);
    let a = Engine::new(cpu_model, 64)?.generate(&prompt, 16, Sampling::GREEDY)?;
    let b = Engine::new(gpu_model, 64)?.generate(&prompt, 16, Sampling::GREEDY)?;
    assert_eq!(a.tokens, b.tokens, "greedy tokens, CPU vs GPU");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_on_the_gpu_with_a_sidecar_reuses_the_prefix() -> Result<()> {
    if !have_gpu("serving_on_the_gpu_with_a_sidecar_reuses_the_prefix") {
        return Ok(());
    }
    let prompt =
        "The GPU worker stores its prompt blocks in kvtier and loads them on the next turn.";
    let want = {
        let model = Model::random(ModelConfig::default(), 0)?;
        let g = Engine::new(model, 64)?.generate(
            &ByteTokenizer.encode(prompt, true),
            12,
            Sampling::GREEDY,
        )?;
        ByteTokenizer.decode(&g.tokens)?
    };
    let dir = tempfile::tempdir()?;
    let (server, unix, _tcp) = start_kvtier(&kvtier_config(dir.path(), "8MiB", 4)?).await?;
    let w = WorkerServer::start(ServeConfig {
        device: DeviceSpec::Cuda(0),
        ..worker_config(Some(unix))
    })
    .await?;
    let full_blocks = (prompt.len() as u64 + 1) / 16;
    let mut cached = Vec::new();
    for turn in 0..2 {
        let r = post(
            w.addr(),
            "/v1/completions",
            &json!({"model": "kvtier-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}),
        )
        .await?;
        ensure!(r.status == 200, "status {}: {}", r.status, r.body);
        let v = r.json()?;
        let text = v["choices"][0]["text"].as_str().context("text")?;
        assert_eq!(
            text, want,
            "turn {turn}: GPU output equals the CPU reference"
        );
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
        if turn == 0 {
            let m = w.metrics().clone();
            wait_for(Duration::from_secs(20), || {
                m.blocks_stored.load(std::sync::atomic::Ordering::Relaxed) >= full_blocks
            })
            .await?;
        }
    }
    assert_eq!(cached, [Some(0), Some(full_blocks * 16)]);
    w.shutdown().await;
    server.shutdown().await;
    Ok(())
}

/// Runs everywhere: settings that cannot work are refused before any GPU is touched.
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

/// Runs everywhere: a GPU model with a host pool (or the reverse) is refused, not run.
#[test]
fn an_engine_refuses_a_pool_on_the_wrong_device() -> Result<()> {
    let layout = ModelConfig::default().kv_layout()?;
    let cpu = Model::random(ModelConfig::default(), 0)?;
    assert_eq!(cpu.device(), DeviceSpec::Cpu);
    Engine::with_cache(cpu, PagedKvCache::new(layout, 4)?)?;
    if !have_gpu("an_engine_refuses_a_pool_on_the_wrong_device (GPU half)") {
        return Ok(());
    }
    let (cpu, gpu) = models(0)?;
    let host = PagedKvCache::new(layout, 4)?;
    let dev = PagedKvCache::on_gpu(layout, 4, gpu.gpu().context("gpu")?)?;
    assert!(Engine::with_cache(gpu, host).is_err());
    assert!(Engine::with_cache(cpu, dev).is_err());
    Ok(())
}
