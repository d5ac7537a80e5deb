//! Prefix reuse at the library level: blocks stored through `Sidecar` into a real
//! kvtier-server and loaded back (zero-copy pin over the Unix socket, `get_into` over TCP)
//! give the same logits as recomputing the prompt.

mod common;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::*;
use kvtier_core::HashSecret;
use kvtier_worker::metrics::Metrics;
use kvtier_worker::sidecar::{PrefixSource, Sidecar, SidecarSettings, StoreJob};
use kvtier_worker::{BlockTable, ByteTokenizer, Engine, Model, ModelConfig};

/// Largest accepted |loaded - recomputed| of a logit (f32; measured 0 to ~1e-6, see
/// docs/worker.md).
const TOLERANCE: f32 = 1e-4;

fn engine() -> Result<Engine> {
    Ok(Engine::new(Model::random(ModelConfig::default(), 0)?, 64)?)
}

async fn check_round_trip(
    url: String,
    quic_cert_der: Option<Vec<u8>>,
    salt: Option<&[u8]>,
) -> Result<f32> {
    let cfg = ModelConfig::default();
    let metrics = Arc::new(Metrics::default());
    let sc = Sidecar::connect(
        SidecarSettings {
            url,
            token: Some(TOKEN.into()),
            quic_cert_der,
            secret: HashSecret::development(),
            model_id: "kvtier-tiny".into(),
        },
        cfg.kv_layout()?,
        metrics.clone(),
    )
    .await?;
    let prompt = ByteTokenizer.encode(
        "Loading a prefix from kvtier must give the same output as recomputing it.",
        true,
    );
    let bt = cfg.block_tokens;
    let full = prompt.len() / bt;

    // Worker A computes the whole prompt and stores its full blocks.
    let mut a = engine()?;
    let mut ta = BlockTable::new();
    let want = a.prefill(&prompt, 0, &mut ta)?;
    let keys = sc.keys(&prompt, salt)?;
    assert_eq!(keys.len(), full);
    let queued = sc.queue_store(|| {
        let mut bytes = Vec::new();
        for id in &ta.blocks()[..full] {
            bytes.extend_from_slice(a.cache().block_bytes(*id).ok()?);
        }
        Some(StoreJob {
            keys: keys.clone(),
            parent: None,
            bytes,
            retain: None,
        })
    });
    ensure!(queued);
    wait_for(Duration::from_secs(10), || {
        metrics.blocks_stored.get() >= full as u64
    })
    .await?;

    // Worker B loads them and computes only the rest.
    let prefix = sc.prepare(&prompt, salt).await;
    ensure!(
        prefix.source.blocks() == full,
        "loaded {}",
        prefix.source.blocks()
    );
    ensure!(prefix.store_from == full);
    let mut b = engine()?;
    let _skip = b.cache_mut().allocate()?; // other block ids than A's
    let mut tb = BlockTable::new();
    b.cache_mut().reserve(&mut tb, prompt.len())?;
    for i in 0..full {
        b.cache_mut()
            .write_block(tb.blocks()[i], prefix.source.block(i))?;
        assert_eq!(
            b.cache().block_bytes(tb.blocks()[i])?,
            a.cache().block_bytes(ta.blocks()[i])?,
            "block {i} came back with other bytes"
        );
    }
    drop(prefix);
    let got = b.prefill(&prompt, full * bt, &mut tb)?;
    let diff = want
        .iter()
        .zip(&got)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    ensure!(diff <= TOLERANCE, "max |diff| {diff}");

    // Another tenant's salt shares nothing.
    let other = sc.prepare(&prompt, Some(b"another-tenant")).await;
    ensure!(matches!(other.source, PrefixSource::None));
    ensure!(other.store_from == 0);
    sc.close(Duration::from_secs(5)).await;
    Ok(diff)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loaded_prefix_logits_equal_recomputed_over_unix_tcp_tls_and_quic() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = kvtier_config(dir.path(), "8MiB", 4)?;
    let (server, unix, tcp) = start_kvtier(&cfg).await?;
    let e = server.endpoints();
    let quic = format!("quic://{}", e.quic.context("quic listener")?);
    let tls = format!("tls://{}", e.tls.context("tls listener")?);
    let cert = e.quic_cert_der.clone();
    let d1 = check_round_trip(unix, None, None).await?;
    let d2 = check_round_trip(tcp, None, Some(b"tenant-a")).await?;
    let d3 = check_round_trip(quic, Some(cert.clone()), Some(b"tenant-b")).await?;
    let d4 = check_round_trip(tls, Some(cert), Some(b"tenant-c")).await?;
    println!("max |loaded - recomputed| logits: unix {d1:e}, tcp {d2:e}, quic {d3:e}, tls {d4:e}");
    server.shutdown().await;
    Ok(())
}
