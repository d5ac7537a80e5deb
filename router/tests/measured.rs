//! kvtier-router's real binary in front of stand-in workers whose speeds the test sets
//! (`common::stub`): what the router measures from the answers it passes through (prefill
//! rate, decode step, load bandwidth per tier) shows in `/debug/route` and moves its
//! decisions, and a session stays on its home worker while that worker holds its prefix,
//! until the home is far slower. Each test bounds its own time; the router is killed and the
//! stubs stopped when it ends.

mod common;

use anyhow::Result;
use common::stub::{self, BLOCK_BYTES, Speed};
use common::*;
use kvtier_client::http::HttpRequest;
use kvtier_client::http::header::HeaderName;
use serde_json::{Value, json};

const SESSION: &str = "x-session-id";

/// `/debug/route` for `body`, as the session `session` when given.
async fn route(url: &str, body: &Value, session: Option<&str>) -> Result<Value> {
    let mut req = HttpRequest::post_json(format!("{url}/debug/route"), body.to_string());
    if let Some(s) = session {
        req = req.header(HeaderName::from_static(SESSION), s);
    }
    let r = http().send(req).await?;
    anyhow::ensure!(r.status == 200, "debug/route: {} {}", r.status, r.text());
    Ok(json(&r))
}

/// Sends `body` as a streamed completion (as the session when given); the worker that
/// answered, once the whole answer is read.
async fn send(url: &str, body: &Value, session: Option<&str>) -> Result<String> {
    let mut req = HttpRequest::post_json(format!("{url}/v1/completions"), body.to_string());
    if let Some(s) = session {
        req = req.header(HeaderName::from_static(SESSION), s);
    }
    let r = http().send(req).await?;
    anyhow::ensure!(r.status == 200, "completion: {} {}", r.status, r.text());
    anyhow::ensure!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
    Ok(answered_by(&r))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// A stand-in's speed: its prefill rate and decode step, loading at 3 MB/s.
fn speed(prefill_tokens_per_s: f64, decode_step_s: f64) -> Speed {
    Speed {
        prefill_tokens_per_s,
        decode_step_s,
        load_bytes_per_s: 3e6,
    }
}

/// `x` within a factor `k` of `want`.
fn near(x: f64, want: f64, k: f64) -> bool {
    x >= want / k && x <= want * k
}

/// Worker A prefills at 350 tokens/s and "loads" at 3 MB/s; worker B prefills at 3000
/// tokens/s. The router learns both rates from cold prompts and then sends cold prompts to B;
/// a session placed on A stays there while A holds its growing prefix, although B is expected
/// to answer first (but not twice as soon), until A's measured load bandwidth makes it far
/// slower than B: then the session leaves for B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_rates_and_session_affinity_through_the_router() -> Result<()> {
    bounded(180, async {
        let a = stub::start(speed(350.0, 0.01)).await?;
        let b = stub::start(speed(3000.0, 0.02)).await?;
        let (_router, url) = router(&[
            "--worker".into(),
            a.url.clone(),
            "--worker".into(),
            b.url.clone(),
            "--recent-route-ttl-ms".into(),
            "300000".into(),
        ])?;

        // Cold prompts, one at a time, until the router has measured both workers.
        let mut seed = 0;
        let measured = |v: &Value, w: &str| {
            let m = &entry(v, w)["measured"];
            m["prefill_samples"].as_u64() >= Some(3) && m["decode_samples"].as_u64() >= Some(3)
        };
        loop {
            let v = route(&url, &completion(&text(seed, 600), 4, true), None).await?;
            if measured(&v, &a.url) && measured(&v, &b.url) {
                break;
            }
            assert!(seed < 12, "not measured after {seed} cold prompts: {v}");
            send(&url, &completion(&text(seed, 600), 4, true), None).await?;
            seed += 1;
        }
        let cold = completion(&text(100, 600), 4, true);
        let v = route(&url, &cold, None).await?;
        let (ea, eb) = (entry(&v, &a.url), entry(&v, &b.url));
        let (ma, mb) = (&ea["measured"], &eb["measured"]);
        // The measured rates are the stubs' speeds, and they are what the scores use.
        assert!(near(f(&ma["prefill_tokens_per_s"]), 350.0, 1.25), "{v}");
        assert!(near(f(&mb["prefill_tokens_per_s"]), 3000.0, 1.5), "{v}");
        assert!(near(f(&ma["decode_step_s"]), 0.01, 2.0), "{v}");
        assert!(near(f(&mb["decode_step_s"]), 0.02, 2.0), "{v}");
        for (e, m) in [(ea, ma), (eb, mb)] {
            assert_eq!(e["prefill_tokens_per_s"], m["prefill_tokens_per_s"], "{v}");
            assert_eq!(e["decode_step_s"], m["decode_step_s"], "{v}");
        }
        // A cold prompt now goes to B: A's measured rate makes its prefill 8 times as long.
        assert_eq!(v["order"][0], b.url.as_str(), "{v}");
        assert!(f(&ea["prefill_s"]) > 4.0 * f(&eb["prefill_s"]), "{v}");
        // No load measured yet: the configured bandwidths, no samples.
        let dram = &ma["load_bytes_per_s"]["dram"];
        assert_eq!(
            (
                dram["measured"].clone(),
                dram["configured"].clone(),
                dram["samples"].clone()
            ),
            (Value::Null, json!(2e9), json!(0)),
            "{v}"
        );

        // A new session is placed by load alone (both idle: a tie, taken in turn). Put it on
        // A: a cold request in between (to B) moves the turn on.
        let mut prompt = text(200, 1000);
        let turn1 = completion(&prompt, 4, true);
        for _ in 0..3 {
            let v = route(&url, &turn1, Some("s1")).await?;
            assert_eq!(v["placement"], "new_session", "{v}");
            if v["order"][0] == a.url.as_str() {
                break;
            }
            seed += 1;
            assert_eq!(
                send(&url, &completion(&text(seed, 300), 2, true), None).await?,
                b.url
            );
        }
        assert_eq!(send(&url, &turn1, Some("s1")).await?, a.url, "turn 1");

        // Turns 2-4: each prompt extends the last. A holds all but ~200 tokens of it (0.6 s at
        // 350 tokens/s); B holds nothing (0.4-0.6 s at 3000): B is expected first, but not
        // twice as soon, so the session stays home.
        for turn in 2..=4 {
            prompt.push_str(&text(300 + turn, 200));
            let body = completion(&prompt, 4, true);
            let v = route(&url, &body, Some("s1")).await?;
            assert_eq!(
                (v["placement"].as_str(), v["order"][0].as_str()),
                (Some("home"), Some(a.url.as_str())),
                "turn {turn}: {v}"
            );
            assert!(
                entry(&v, &a.url)["cached_tokens"].as_u64() > Some(900),
                "{v}"
            );
            if turn == 2 {
                // Without the session the expected TTFT alone decides: B.
                let v = route(&url, &body, None).await?;
                assert_eq!(
                    (v["placement"].as_str(), v["order"][0].as_str()),
                    (Some("expected_ttft"), Some(b.url.as_str())),
                    "{v}"
                );
            }
            assert_eq!(send(&url, &body, Some("s1")).await?, a.url, "turn {turn}");
        }

        // A's loads (2-2.9 MB each, at 3 MB/s) have made its DRAM bandwidth measured.
        prompt.push_str(&text(305, 200));
        let body = completion(&prompt, 4, true);
        let v = route(&url, &body, Some("s1")).await?;
        let ea = entry(&v, &a.url);
        let dram = &ea["measured"]["load_bytes_per_s"]["dram"];
        assert_eq!(
            (dram["samples"].as_u64(), dram["configured"].as_f64()),
            (Some(3), Some(2e9)),
            "{v}"
        );
        assert!(near(f(&dram["measured"]), 3e6, 1.25), "{v}");
        // The load report's time is not counted as prefill: A's rate is still its speed.
        assert!(near(f(&ea["prefill_tokens_per_s"]), 350.0, 1.25), "{v}");
        // Loading A's 100 blocks at that rate takes over a second: the session leaves.
        assert_eq!(
            (v["placement"].as_str(), v["order"][0].as_str()),
            (Some("left_home"), Some(b.url.as_str())),
            "{v}"
        );
        let blocks = ea["cached_blocks_by_tier"][1].as_u64().unwrap_or(0);
        assert!(blocks >= 100, "{v}");
        assert_eq!(ea["load_bytes_per_s"][1], dram["measured"], "{v}");
        let want = blocks as f64 * BLOCK_BYTES as f64 / f(&dram["measured"]);
        assert!((f(&ea["load_s"]) - want).abs() < 1e-6, "{v}");
        assert_eq!(send(&url, &body, Some("s1")).await?, b.url, "turn 5");

        // Every answer's report was read: samples from A's loads, nothing loaded elsewhere,
        // none bad or unreadable.
        let m = get(&format!("{url}/metrics")).await?.text();
        let reports = |w: &str, o: &str| load_reports(&m, w, o);
        assert_eq!(reports(&a.url, "dram"), 3.0, "{m}");
        assert!(reports(&b.url, "nothing_loaded") >= 3.0, "{m}");
        for o in ["bad", "malformed", "absent", "mixed_tiers"] {
            assert_eq!(
                metric(&m, "kvtier_router_load_reports_total", &[("outcome", o)]),
                0.0,
                "{o}: {m}"
            );
        }
        // Each routed request of the session counted by its placement (/debug/route's are
        // not routed): its first turn, three at home, the one that left.
        let placed = |p: &str| metric(&m, "kvtier_router_placements_total", &[("placement", p)]);
        assert_eq!(
            [placed("new_session"), placed("home"), placed("left_home")],
            [1.0, 3.0, 1.0],
            "{m}"
        );
        assert!(placed("expected_ttft") >= 4.0, "{m}");
        Ok(())
    })
    .await
}

/// Opens a streamed completion of `body` and leaves it open (the worker keeps decoding it);
/// the stream and the worker answering it.
async fn open(url: &str, body: &Value) -> Result<(kvtier_client::http::HttpStream, String)> {
    let s = http()
        .stream(HttpRequest::post_json(
            format!("{url}/v1/completions"),
            body.to_string(),
        ))
        .await?;
    anyhow::ensure!(s.status == 200, "completion: {}", s.status);
    let w = s
        .headers
        .get("x-kvtier-worker")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Ok((s, w))
}

/// Workers B and C prefill at about the same rate (C a little faster), but one decode step
/// takes B 20 ms and C 100 ms. Every sequence decoding on a worker takes a step per prefill
/// chunk of a new prompt, so once the router has measured the steps it sends a second and a
/// third long answer to B, though C prefills faster and holds one answer fewer; with the
/// configured step (10 ms for both) the third would go to C.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_measured_decode_step_moves_the_decision() -> Result<()> {
    bounded(120, async {
        let b = stub::start(speed(3000.0, 0.02)).await?;
        let c = stub::start(speed(3300.0, 0.1)).await?;
        let (_router, url) = router(&[
            "--worker".into(),
            b.url.clone(),
            "--worker".into(),
            c.url.clone(),
        ])?;
        // Cold prompts in turn until both are measured (B, first in turn, is measured first;
        // then C, still at the configured 3000 tokens/s, is the faster one).
        let mut seed = 0;
        let measured = |v: &Value, w: &str| {
            let m = &entry(v, w)["measured"];
            m["prefill_samples"].as_u64() >= Some(3) && m["decode_samples"].as_u64() >= Some(3)
        };
        loop {
            let v = route(&url, &completion(&text(seed, 600), 4, true), None).await?;
            if measured(&v, &b.url) && measured(&v, &c.url) {
                break;
            }
            assert!(seed < 12, "not measured after {seed} cold prompts: {v}");
            send(&url, &completion(&text(seed, 600), 4, true), None).await?;
            seed += 1;
        }
        // Three long answers, left decoding: the first to C (the faster prefill), the next two
        // to B (C's one decoding answer costs the new prompt 2 x 100 ms; B's, 2 x 20 ms).
        let mut open_streams = Vec::new();
        for (i, want) in [&c.url, &b.url, &b.url].into_iter().enumerate() {
            let body = completion(&text(500 + i as u64, 600), 1000, true);
            let (s, w) = open(&url, &body).await?;
            let v = route(&url, &completion(&text(600, 600), 4, true), None).await?;
            assert_eq!(&w, want, "long answer {i}: {v}");
            open_streams.push(s);
        }
        // The queue's decode part is the decoding answers' measured steps, a step per chunk of
        // the new 601-token prompt (2 chunks of 512).
        let v = route(&url, &completion(&text(600, 600), 4, true), None).await?;
        for (w, decoding, step) in [(&b.url, 2, 0.02), (&c.url, 1, 0.1)] {
            let e = entry(&v, w);
            let m = &e["measured"];
            assert!(near(f(&m["decode_step_s"]), step, 2.0), "{v}");
            assert_eq!(e["decode_step_s"], m["decode_step_s"], "{v}");
            assert_eq!(e["decoding_requests"], decoding, "{v}");
            let want = decoding as f64 * 2.0 * f(&m["decode_step_s"]);
            assert!((f(&e["queue_decode_s"]) - want).abs() < 1e-9, "{v}");
        }
        assert_eq!(v["order"][0], b.url.as_str(), "{v}");
        drop(open_streams);
        Ok(())
    })
    .await
}
