//! The router's own cost: the latency it adds to a request and the requests per second it
//! routes. Stand-in workers (in-process axum servers that answer at once, so the figures are
//! the router's and the loopback's, not a model's) behind an in-process router; each request
//! is sent straight to a worker and through the router, alternately, and the latencies are
//! compared. Prompts are `--prompt-tokens` bytes of text (the byte tokenizer: one token per
//! byte, plus BOS), so every routed request is parsed, tokenized, hashed and scored in full.
//!
//! `cargo run --release -p kvtier-router --example overhead -- --requests 2000`

use std::time::{Duration, Instant};

use anyhow::Result;
use axum::routing::{get, post};
use clap::Parser;
use hdrhistogram::Histogram;
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest};
use kvtier_router::{Router, RouterConfig, WorkerConfig};

#[derive(Parser)]
struct Args {
    /// Requests each way (direct, routed).
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Requests in flight at once for the throughput run.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
}

const ANSWER: &str = r#"{"id":"cmpl-1","object":"text_completion","created":0,"model":"kvtier-tiny","choices":[{"index":0,"text":"ok","finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#;

async fn stand_in() -> Result<String> {
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            post(|_: axum::body::Bytes| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    ANSWER,
                )
            }),
        )
        .route("/health", get(|| async { "{}" }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    tokio::spawn(async move { axum::serve(l, app).await });
    Ok(url)
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let mut workers = Vec::new();
    for _ in 0..a.workers {
        workers.push(stand_in().await?);
    }
    let config = RouterConfig {
        listen: "127.0.0.1:0".into(),
        workers: workers
            .iter()
            .map(|u| WorkerConfig {
                url: u.clone(),
                kvtier: None,
                kvtier_token: None,
                prefill_tokens_per_s: None,
            })
            .collect(),
        ..RouterConfig::default()
    };
    let router = Router::start(config).await?;
    let routed = format!("http://{}/v1/completions", router.addr());
    let http = HttpClient::new(HttpConfig::default());
    let mut rng = kvtier_core::SplitMix64::new(7);
    let prompt = |rng: &mut kvtier_core::SplitMix64| -> String {
        (0..a.prompt_tokens)
            .map(|_| char::from(b'a' + rng.below(26) as u8))
            .collect()
    };
    let body = |p: &str| serde_json::json!({"prompt": p, "max_tokens": 1}).to_string();
    let mut direct_h = Histogram::<u64>::new(3)?;
    let mut routed_h = Histogram::<u64>::new(3)?;
    // Warm the connections.
    for _ in 0..50 {
        let b = body(&prompt(&mut rng));
        http.send(HttpRequest::post_json(&routed, b.clone()))
            .await?;
        http.send(HttpRequest::post_json(
            format!("{}/v1/completions", workers[0]),
            b,
        ))
        .await?;
    }
    for i in 0..a.requests {
        let b = body(&prompt(&mut rng));
        let direct = format!("{}/v1/completions", workers[i % workers.len()]);
        for (url, h) in [(&direct, &mut direct_h), (&routed, &mut routed_h)] {
            let t = Instant::now();
            let r = http.send(HttpRequest::post_json(url, b.clone())).await?;
            anyhow::ensure!(r.status == 200, "{}", r.text());
            h.record(t.elapsed().as_micros() as u64)?;
        }
    }
    println!(
        "{} requests each way, {}-token prompts, {} stand-in workers",
        a.requests, a.prompt_tokens, a.workers
    );
    println!("latency (us)   p50      p99      p99.9");
    for (name, h) in [("direct", &direct_h), ("routed", &routed_h)] {
        println!(
            "{name:<12} {:>7.0}  {:>7.0}  {:>7.0}",
            us(h, 0.5),
            us(h, 0.99),
            us(h, 0.999)
        );
    }
    println!(
        "added        {:>7.0}  {:>7.0}  {:>7.0}",
        us(&routed_h, 0.5) - us(&direct_h, 0.5),
        us(&routed_h, 0.99) - us(&direct_h, 0.99),
        us(&routed_h, 0.999) - us(&direct_h, 0.999)
    );
    // Throughput: `concurrency` clients for a fixed time, routed.
    let bodies: Vec<String> = (0..256).map(|_| body(&prompt(&mut rng))).collect();
    let bodies = std::sync::Arc::new(bodies);
    let until = Instant::now() + Duration::from_secs(5);
    let mut tasks = Vec::new();
    for c in 0..a.concurrency {
        let (http, url, bodies) = (http.clone(), routed.clone(), bodies.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0usize;
            while Instant::now() < until {
                let b = bodies[(c * 31 + n) % bodies.len()].clone();
                if http.send(HttpRequest::post_json(&url, b)).await.is_ok() {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await?;
    }
    println!(
        "throughput: {:.0} routed requests/s ({} clients, 5 s, router, stand-ins and clients in one process)",
        total as f64 / 5.0,
        a.concurrency
    );
    router.shutdown().await;
    Ok(())
}
