//! kvtier-router against the real binaries: kvtier-server sidecars and kvtier-worker processes
//! (the default random-weight model), one sidecar per worker. Each test bounds its own time;
//! every process it starts is killed when the test ends (`common::Proc`).

mod common;

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Result;
use common::*;
use serde_json::{Value, json};

/// Three workers, each with its own kvtier server, behind a router.
struct Fleet {
    _dir: tempfile::TempDir,
    servers: Vec<KvServer>,
    workers: Vec<(Proc, String)>,
    router: Proc,
    url: String,
    /// The router's arguments (to start it again).
    args: Vec<String>,
}

fn fleet(n: usize, router_extra: &[String]) -> Result<Fleet> {
    let dir = tempfile::tempdir()?;
    let mut servers = Vec::new();
    let mut workers = Vec::new();
    let mut args: Vec<String> = vec!["--health-interval-ms".into(), "200".into()];
    for i in 0..n {
        let s = KvServer::start(&dir.path().join(format!("s{i}")))?;
        let w = worker("127.0.0.1:0", &s.url(), &[])?;
        args.push("--worker".into());
        args.push(format!("{},kvtier={}", w.1, s.url()));
        servers.push(s);
        workers.push(w);
    }
    args.extend(router_extra.iter().cloned());
    let (router, url) = router(&args)?;
    Ok(Fleet {
        _dir: dir,
        servers,
        workers,
        router,
        url,
        args,
    })
}

/// `/debug/route`'s view of `body`.
async fn route(url: &str, body: &Value) -> Result<Value> {
    let r = post(&format!("{url}/debug/route"), body).await?;
    anyhow::ensure!(r.status == 200, "debug/route: {} {}", r.status, r.text());
    Ok(json(&r))
}

fn cached(r: &Value) -> u64 {
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {r}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_goes_to_the_worker_holding_its_prefix() -> Result<()> {
    bounded(240, async {
        let f = fleet(3, &[])?;
        let prompt = text(1, 700);
        let r = post(&format!("{}/v1/completions", f.url), &completion(&prompt, 8, false)).await?;
        assert_eq!(r.status, 200, "{}", r.text());
        let first = json(&r);
        let holder = answered_by(&r);
        assert!(f.workers.iter().any(|w| w.1 == holder), "answered by {holder:?}");
        // Once the holder's blocks are stored, its server's events make it the first choice.
        let body = completion(&prompt, 8, false);
        wait_until(Duration::from_secs(60), "the holder's blocks in the index", || async {
            let v = route(&f.url, &body).await?;
            Ok(v["order"][0] == holder.as_str() && entry(&v, &holder)["cached_tokens"].as_u64() > Some(600))
        })
        .await?;
        let v = route(&f.url, &body).await?;
        // 700 tokens: 43 full blocks, the last token recomputed: 43 usable.
        assert_eq!(entry(&v, &holder)["cached_tokens"], 688, "{v}");
        for w in &f.workers {
            if w.1 != holder {
                assert_eq!(entry(&v, &w.1)["cached_tokens"], 0, "{v}");
            }
        }
        // The same prompt and an agent's next turn go to the holder, which finds them cached,
        // and the text is the holder's.
        for (i, p) in [prompt.clone(), format!("{prompt} and then the next turn"), prompt.clone()]
            .iter()
            .enumerate()
        {
            let r = post(&format!("{}/v1/completions", f.url), &completion(p, 8, false)).await?;
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(answered_by(&r), holder, "request {i}");
            let a = json(&r);
            assert!(cached(&a) >= 688, "request {i}: {a}");
            if i != 1 {
                assert_eq!(a["choices"][0]["text"], first["choices"][0]["text"]);
            }
        }
        // Cold prompts spread over the workers (equal scores take turns).
        let mut seen = HashSet::new();
        for i in 0..3 {
            let r = post(&format!("{}/v1/completions", f.url), &completion(&text(100 + i, 300), 4, false)).await?;
            assert_eq!(r.status, 200, "{}", r.text());
            seen.insert(answered_by(&r));
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        let m = get(&format!("{}/metrics", f.url)).await?.text();
        kvtier_testkit::promtool::check_metrics(&m)?;
        assert_eq!(metric(&m, "kvtier_router_key_mismatch_suspected", &[]), 0.0, "{m}");
        assert_eq!(metric(&m, "kvtier_router_cache_mismatch_total", &[]), 0.0, "{m}");
        assert!(metric(&m, "kvtier_router_predicted_cached_tokens_total", &[("worker", &holder)]) >= 3.0 * 688.0);
        assert_eq!(metric(&m, "kvtier_router_requests_total", &[("outcome", "ok")]), 7.0, "{m}");
        assert_eq!(metric(&m, "kvtier_router_index_synced", &[]), 3.0, "{m}");
        // kvtier-worker's usage.kvtier load report is read from every answer: none absent,
        // unreadable or impossible.
        assert_eq!(metric(&m, "kvtier_router_load_reports_total", &[]), 7.0, "{m}");
        for o in ["absent", "malformed", "bad"] {
            assert_eq!(metric(&m, "kvtier_router_load_reports_total", &[("outcome", o)]), 0.0, "{o}: {m}");
        }
        // The rest of the front.
        let models = json(&get(&format!("{}/v1/models", f.url)).await?);
        assert_eq!(models["data"][0]["id"], "kvtier-tiny");
        let h = get(&format!("{}/health", f.url)).await?;
        assert_eq!((h.status, json(&h)["healthy_workers"].clone()), (200, json!(3)));
        for (body, status, param) in [
            (json!({"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
            (json!({"prompt": "x", "model": "other"}), 404, "model"),
            (json!({"messages": []}), 400, "messages"),
        ] {
            let r = post(&format!("{}/v1/completions", f.url), &body).await?;
            assert_eq!(r.status, status, "{body}: {}", r.text());
            assert_eq!(json(&r)["error"]["param"], param, "{}", r.text());
        }
        let r = http()
            .send(kvtier_client::http::HttpRequest::post_json(format!("{}/v1/completions", f.url), "{not json"))
            .await?;
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(get(&format!("{}/nope", f.url)).await?.status, 404);
        // A chat request is rendered and hashed as the workers do: the repeat is predicted.
        let chat = json!({"messages": [{"role": "user", "content": text(7, 400)}], "max_tokens": 4, "temperature": 0});
        let r = post(&format!("{}/v1/chat/completions", f.url), &chat).await?;
        assert_eq!(r.status, 200, "{}", r.text());
        let chat_holder = answered_by(&r);
        wait_until(Duration::from_secs(60), "the chat prompt's blocks", || async {
            let v = route(&f.url, &chat).await?;
            Ok(v["endpoint"] == "chat" && v["order"][0] == chat_holder.as_str() && entry(&v, &chat_holder)["cached_tokens"].as_u64() > Some(300))
        })
        .await?;
        let r = post(&format!("{}/v1/chat/completions", f.url), &chat).await?;
        assert_eq!(answered_by(&r), chat_holder);
        assert!(cached(&json(&r)) > 300);
        drop(f.router);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_run_does_not_fail_requests() -> Result<()> {
    bounded(300, async {
        let mut f = fleet(3, &[])?;
        let victim = f.workers[1].1.clone();
        let port = victim.rsplit(':').next().unwrap_or_default().to_owned();
        // Long answers, so some are in flight on the victim when it dies.
        let url = format!("{}/v1/completions", f.url);
        let mut tasks = Vec::new();
        for i in 0..6 {
            let (url, body) = (url.clone(), completion(&text(200 + i, 200), 400, false));
            tasks.push(tokio::spawn(async move { post(&url, &body).await }));
        }
        wait_until(
            Duration::from_secs(30),
            "a request in flight on the victim",
            || async {
                let h = json(&get(&format!("{}/health", f.url)).await?);
                let w = h["workers"]
                    .as_array()
                    .and_then(|a| a.iter().find(|w| w["url"] == victim.as_str()).cloned());
                Ok(w.is_some_and(|w| w["outstanding_requests"].as_u64() >= Some(1)))
            },
        )
        .await?;
        f.workers[1].0.kill();
        for t in tasks {
            let r = t.await??;
            assert_eq!(r.status, 200, "{}", r.text());
            assert_ne!(answered_by(&r), victim);
        }
        let m = get(&format!("{}/metrics", f.url)).await?.text();
        assert!(
            metric(&m, "kvtier_router_retries_total", &[("worker", &victim)]) >= 1.0,
            "{m}"
        );
        let h = json(&get(&format!("{}/health", f.url)).await?);
        assert_eq!(h["healthy_workers"], 2, "{h}");
        // Out of the candidates: nothing more is sent to it.
        for i in 0..4 {
            let r = post(&url, &completion(&text(300 + i, 100), 4, false)).await?;
            assert_eq!(r.status, 200, "{}", r.text());
            assert_ne!(answered_by(&r), victim);
        }
        let m2 = get(&format!("{}/metrics", f.url)).await?.text();
        assert_eq!(
            metric(&m, "kvtier_router_retries_total", &[("worker", &victim)]),
            metric(&m2, "kvtier_router_retries_total", &[("worker", &victim)]),
        );
        // Back on the same port: healthy again, and chosen again.
        let sidecar = f.servers[1].url();
        f.workers[1] = worker(&format!("127.0.0.1:{port}"), &sidecar, &[])?;
        wait_until(
            Duration::from_secs(30),
            "the victim healthy again",
            || async {
                Ok(json(&get(&format!("{}/health", f.url)).await?)["healthy_workers"] == 3)
            },
        )
        .await?;
        let mut seen = HashSet::new();
        for i in 0..3 {
            let r = post(&url, &completion(&text(400 + i, 100), 4, false)).await?;
            assert_eq!(r.status, 200, "{}", r.text());
            seen.insert(answered_by(&r));
        }
        assert!(seen.contains(&victim), "{seen:?}");
        // Every worker down: a clear 502, no hang.
        for w in &mut f.workers {
            w.0.kill();
        }
        let r = post(&url, &completion("x", 2, false)).await?;
        assert_eq!(r.status, 502, "{}", r.text());
        assert_eq!(json(&r)["error"]["code"], "no_worker");
        Ok(())
    })
    .await
}

/// Whether the router's prediction for `prompt` on worker `w` equals what its server `sock`
/// answers for the same keys (and the index is synced); and that number of usable blocks.
async fn prediction_agrees(
    url: String,
    w: String,
    sock: String,
    keys: kvtier_worker::prefix_cache::BlockKeys,
    prompt: String,
) -> Result<(bool, usize)> {
    use kvtier_client::{Client, ClientConfig};
    let body = completion(&prompt, 4, false);
    let v = route(&url, &body).await?;
    let e = entry(&v, &w);
    // The worker's own tokenizer (the byte tokenizer puts BOS in front).
    let tokens = kvtier_worker::Tokenizer::Byte.encode(&prompt, true)?;
    let ks = keys.keys(&tokens, None)?;
    let c = Client::connect(&sock, ClientConfig::default().zero_copy(false)).await?;
    let held = c.lookup(&ks).await.tiers.len();
    let usable = held.min((tokens.len() - 1) / 16);
    let predicted = e["cached_blocks"].as_u64().unwrap_or(0) as usize;
    Ok((e["kvtier"]["synced"] == true && predicted == usable, usable))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_a_server_restart() -> Result<()> {
    use kvtier_worker::prefix_cache::BlockKeys;
    bounded(240, async {
        let mut f = fleet(1, &[])?;
        let w = f.workers[0].1.clone();
        let layout = kvtier_worker::ModelConfig::default().kv_layout()?;
        let keys = BlockKeys::new(
            kvtier_core::HashSecret::development(),
            "kvtier-tiny".into(),
            layout,
        );
        let sock = f.servers[0].url();
        let agree = |prompt: String| {
            prediction_agrees(f.url.clone(), w.clone(), sock.clone(), keys.clone(), prompt)
        };
        let p = text(3, 500);
        let r = post(
            &format!("{}/v1/completions", f.url),
            &completion(&p, 4, false),
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text());
        wait_until(
            Duration::from_secs(60),
            "the prompt's blocks predicted",
            || async {
                let (ok, usable) = agree(p.clone()).await?;
                Ok(ok && usable == 31)
            },
        )
        .await?;
        f.servers[0].restart()?;
        // The subscription is lost, then taken up again with a snapshot of what the restarted
        // server holds (its NVMe tier kept the blocks).
        wait_until(
            Duration::from_secs(60),
            "resubscribed after the restart",
            || async {
                let m = get(&format!("{}/metrics", f.url)).await?.text();
                Ok(metric(&m, "kvtier_router_index_resyncs_total", &[]) >= 1.0
                    && metric(&m, "kvtier_router_index_synced", &[]) == 1.0)
            },
        )
        .await?;
        wait_until(
            Duration::from_secs(60),
            "the prediction equal to the restarted server's lookup",
            || async {
                let (ok, usable) = agree(p.clone()).await?;
                Ok(ok && usable == 31)
            },
        )
        .await?;
        // New blocks after the restart arrive on the new subscription.
        let q = text(4, 400);
        let r = post(
            &format!("{}/v1/completions", f.url),
            &completion(&q, 4, false),
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text());
        wait_until(
            Duration::from_secs(60),
            "the new prompt's blocks predicted",
            || async {
                let (ok, usable) = agree(q.clone()).await?;
                Ok(ok && usable == 25)
            },
        )
        .await?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_rebuilds_its_index_from_snapshots() -> Result<()> {
    bounded(180, async {
        let mut f = fleet(2, &[])?;
        let prompt = text(11, 600);
        let body = completion(&prompt, 4, false);
        let r = post(&format!("{}/v1/completions", f.url), &body).await?;
        assert_eq!(r.status, 200, "{}", r.text());
        let holder = answered_by(&r);
        let predicted = |url: String| {
            let (body, holder) = (body.clone(), holder.clone());
            async move {
                let v = route(&url, &body).await?;
                Ok::<_, anyhow::Error>((
                    v["order"][0] == holder.as_str(),
                    entry(&v, &holder)["cached_tokens"].clone(),
                ))
            }
        };
        wait_until(Duration::from_secs(60), "the holder predicted", || async {
            Ok(predicted(f.url.clone()).await? == (true, json!(592)))
        })
        .await?;
        // A new router knows nothing but what the servers' snapshots tell it.
        f.router.kill();
        let (router, url) = router(&f.args)?;
        f.router = router;
        f.url = url;
        wait_until(
            Duration::from_secs(60),
            "the holder predicted again",
            || async { Ok(predicted(f.url.clone()).await? == (true, json!(592))) },
        )
        .await?;
        let r = post(&format!("{}/v1/completions", f.url), &body).await?;
        assert_eq!(answered_by(&r), holder);
        assert!(cached(&json(&r)) >= 592, "{}", r.text());
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_another_secret_reports_a_key_mismatch() -> Result<()> {
    bounded(180, async {
        let dir = tempfile::tempdir()?;
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "not-the-workers-secret-0123456789\n")?;
        let f = fleet(
            1,
            &[
                "--hash-secret-file".into(),
                secret.display().to_string(),
                "--config".into(),
                {
                    let c = dir.path().join("router.toml");
                    std::fs::write(&c, "mismatch_streak = 3\n")?;
                    c.display().to_string()
                },
            ],
        )?;
        let w = f.workers[0].1.clone();
        let body = completion(&text(5, 400), 4, false);
        for _ in 0..5 {
            let r = post(&format!("{}/v1/completions", f.url), &body).await?;
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let m = get(&format!("{}/metrics", f.url)).await?.text();
        // The worker finds the repeats cached (its own prefix cache), the router predicts
        // nothing: "higher" every time after the first.
        assert_eq!(
            metric(
                &m,
                "kvtier_router_cache_mismatch_total",
                &[("worker", &w), ("direction", "higher")]
            ),
            4.0,
            "{m}"
        );
        assert_eq!(
            metric(
                &m,
                "kvtier_router_key_mismatch_suspected",
                &[("worker", &w)]
            ),
            1.0,
            "{m}"
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_from_a_worker_is_the_workers_stream() -> Result<()> {
    bounded(180, async {
        let dir = tempfile::tempdir()?;
        // No prefix cache: the second answer must not differ by its cached tokens.
        let (_w, wurl) = worker("127.0.0.1:0", "off", &["--no-prefix-cache"])?;
        let (_r, rurl) = router(&[
            "--worker".into(),
            wurl.clone(),
            "--health-interval-ms".into(),
            "200".into(),
        ])?;
        let _ = dir;
        let body = completion(&text(9, 100), 24, true);
        let direct = post(&format!("{wurl}/v1/completions"), &body).await?;
        let routed = post(&format!("{rurl}/v1/completions"), &body).await?;
        assert_eq!(routed.status, 200);
        assert_eq!(routed.content_type, direct.content_type);
        // Each answer's events, without the two fields that differ between any two answers
        // (the request's id and its time).
        let events = |r: &kvtier_client::http::HttpResponse| -> Vec<Value> {
            r.text()
                .split("\n\n")
                .filter_map(|e| e.strip_prefix("data: "))
                .map(|d| match serde_json::from_str::<Value>(d) {
                    Ok(mut v) => {
                        v.as_object_mut().map(|o| {
                            o.remove("id");
                            o.remove("created")
                        });
                        v
                    }
                    Err(_) => json!(d),
                })
                .collect()
        };
        let (d, r) = (events(&direct), events(&routed));
        assert!(
            d.len() > 3 && d.last() == Some(&json!("[DONE]")),
            "{}",
            direct.text()
        );
        assert_eq!(d, r);
        Ok(())
    })
    .await
}

/// A stand-in worker: `/health` answers 200; a POST answers `PIECES` as chunked SSE, the
/// second piece only once `go` fires.
async fn fake_worker(go: tokio::sync::oneshot::Receiver<()>) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    let go = std::sync::Arc::new(tokio::sync::Mutex::new(Some(go)));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let go = go.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let head_end = loop {
                    if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_lowercase();
                if head.starts_with("get /health") {
                    let _ = s
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                        )
                        .await;
                    return;
                }
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while got.len() < head_end + len {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let chunk = |b: &[u8]| {
                    [
                        format!("{:x}\r\n", b.len()).into_bytes(),
                        b.to_vec(),
                        b"\r\n".to_vec(),
                    ]
                    .concat()
                };
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
                    .await;
                let _ = s.write_all(&chunk(PIECES[0])).await;
                if let Some(go) = go.lock().await.take() {
                    let _ = go.await;
                }
                for p in &PIECES[1..] {
                    let _ = s.write_all(&chunk(p)).await;
                }
                let _ = s.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    Ok(url)
}

/// An answer with an event split across pieces, a character split across pieces, a byte that
/// is not UTF-8, and `\r\n` inside.
const PIECES: [&[u8]; 4] = [
    b"data: {\"choices\":[{\"text\":\"caf\xc3",
    b"\xa9\"}]}\n\ndata: {\"x\":\"\xff\r\n\"}\n",
    b"\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
    b"data: [DONE]\n\n",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_passed_through_byte_for_byte_as_it_arrives() -> Result<()> {
    bounded(60, async {
        let (go_tx, go_rx) = tokio::sync::oneshot::channel();
        let upstream = fake_worker(go_rx).await?;
        let (_r, rurl) = router(&["--worker".into(), upstream])?;
        let mut s = http()
            .stream(kvtier_client::http::HttpRequest::post_json(
                format!("{rurl}/v1/completions"),
                completion("hello", 4, true).to_string(),
            ))
            .await?;
        assert_eq!(
            (s.status, s.content_type.as_deref()),
            (200, Some("text/event-stream"))
        );
        // The first piece reaches the client while the worker holds back the rest: nothing
        // waits for the whole answer.
        let mut got = Vec::new();
        while got.len() < PIECES[0].len() {
            let c = s.chunk().await?.expect("the first piece");
            got.extend_from_slice(&c);
        }
        assert_eq!(got, PIECES[0]);
        go_tx.send(()).expect("the worker waits");
        while let Some(c) = s.chunk().await? {
            got.extend_from_slice(&c);
        }
        assert_eq!(got, PIECES.concat());
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_baselines_route_by_session_and_at_random() -> Result<()> {
    bounded(240, async {
        let f = fleet(3, &["--policy".into(), "session_sticky".into()])?;
        let url = format!("{}/v1/completions", f.url);
        // Each session's requests (different prompts) all go to one worker, named by `user`.
        let mut home = Vec::new();
        for s in 0..6 {
            let mut first = None;
            for turn in 0..3 {
                let mut body = completion(&text(1000 + 10 * s + turn, 60), 2, false);
                body["user"] = json!(format!("session-{s}"));
                let r = post(&url, &body).await?;
                assert_eq!(r.status, 200, "{}", r.text());
                let w = answered_by(&r);
                assert_eq!(
                    first.get_or_insert_with(|| w.clone()),
                    &w,
                    "session {s} turn {turn}"
                );
            }
            home.push(first.unwrap_or_default());
        }
        // The x-session-id header overrides the body's user.
        let mut body = completion(&text(2000, 60), 2, false);
        body["user"] = json!("someone-else");
        let r = http()
            .send(
                kvtier_client::http::HttpRequest::post_json(url.clone(), body.to_string()).header(
                    kvtier_client::http::header::HeaderName::from_static("x-session-id"),
                    "session-4",
                ),
            )
            .await?;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(answered_by(&r), home[4]);
        let v = route(&f.url, &body).await?;
        assert_eq!(
            (v["policy"].as_str(), v["session"].as_str()),
            (Some("SessionSticky"), Some("someone-else")),
            "{v}"
        );
        // A killed worker's sessions move to others; the rest stay where they were.
        let mut f = f;
        let (mut dead, dead_url) = f.workers.remove(0);
        dead.kill();
        for (s, was) in home.iter().enumerate() {
            let mut body = completion(&text(3000 + s as u64, 60), 2, false);
            body["user"] = json!(format!("session-{s}"));
            let r = post(&url, &body).await?;
            assert_eq!(r.status, 200, "{}", r.text());
            let now = answered_by(&r);
            if *was == dead_url {
                assert_ne!(now, dead_url, "session {s}");
            } else {
                assert_eq!(&now, was, "session {s}");
            }
        }
        drop(f.router);

        // Random: one session's requests spread over the workers.
        let f = fleet(3, &["--policy".into(), "random".into()])?;
        let mut seen = HashSet::new();
        for i in 0..15 {
            let mut body = completion(&text(4000 + i, 60), 2, false);
            body["user"] = json!("session-0");
            let r = post(&format!("{}/v1/completions", f.url), &body).await?;
            assert_eq!(r.status, 200, "{}", r.text());
            seen.insert(answered_by(&r));
        }
        // All 15 on one worker: probability 3 / 3^15.
        assert!(seen.len() >= 2, "{seen:?}");
        drop(f.router);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_follows_its_worker_before_any_event_shows_its_blocks() -> Result<()> {
    bounded(240, async {
        // Workers without a kvtier server: the router hears no events, only what it routed.
        let mut workers = Vec::new();
        let mut args: Vec<String> = vec!["--health-interval-ms".into(), "200".into()];
        for _ in 0..3 {
            let w = worker("127.0.0.1:0", "off", &[])?;
            args.extend(["--worker".into(), w.1.clone()]);
            workers.push(w);
        }
        let (r, url) = router(&args)?;
        let prompt = text(77, 700);
        let first = post(
            &format!("{url}/v1/completions"),
            &completion(&prompt, 4, false),
        )
        .await?;
        assert_eq!(first.status, 200, "{}", first.text());
        let holder = answered_by(&first);
        let next = format!("{prompt} and the tool's answer");
        let v = route(&url, &completion(&next, 4, false)).await?;
        assert_eq!(v["order"][0], holder.as_str(), "{v}");
        let e = entry(&v, &holder);
        // 700 tokens: 43 full blocks routed there, all usable for the longer prompt.
        assert_eq!(
            (e["routed_blocks"].as_u64(), e["cached_tokens"].as_u64()),
            (Some(43), Some(688)),
            "{v}"
        );
        for (_, w) in &workers {
            if *w != holder {
                assert_eq!(entry(&v, w)["cached_tokens"], 0, "{v}");
            }
        }
        for i in 0..2 {
            let r = post(
                &format!("{url}/v1/completions"),
                &completion(&next, 4, false),
            )
            .await?;
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(answered_by(&r), holder, "request {i}");
            // The worker's own prefix cache had the blocks.
            assert!(cached(&json(&r)) >= 688, "{}", r.text());
        }
        drop(r);
        // Turned off, the same situation is a cold prompt: the ranking takes turns.
        args.extend(["--recent-route-ttl-ms".into(), "0".into()]);
        let (_r, url) = router(&args)?;
        let v = route(&url, &completion(&text(78, 700), 4, false)).await?;
        assert!(
            v["workers"]
                .as_array()
                .is_some_and(|a| a.iter().all(|e| e["cached_tokens"] == 0)),
            "{v}"
        );
        let first = post(
            &format!("{url}/v1/completions"),
            &completion(&text(78, 700), 4, false),
        )
        .await?;
        let v = route(&url, &completion(&text(78, 700), 4, false)).await?;
        assert_eq!(entry(&v, &answered_by(&first))["routed_blocks"], 0, "{v}");
        Ok(())
    })
    .await
}

/// With `--cluster` (the servers are one kvtier cluster), a prefix one worker's server holds
/// counts for every worker, at the cluster's fetch rate: the holder still ranks first (its
/// own DRAM is faster), the others see the blocks as fetchable, not as a cold prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_every_worker_counts_the_blocks_another_server_holds() -> Result<()> {
    bounded(180, async {
        let f = fleet(2, &["--cluster".into()])?;
        let prompt = text(3, 700);
        let r = post(
            &format!("{}/v1/completions", f.url),
            &completion(&prompt, 4, false),
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text());
        let holder = answered_by(&r);
        let other = f
            .workers
            .iter()
            .map(|w| w.1.clone())
            .find(|w| *w != holder)
            .unwrap();
        let body = completion(&prompt, 4, false);
        wait_until(
            Duration::from_secs(60),
            "the holder's blocks in the index",
            || async {
                let v = route(&f.url, &body).await?;
                Ok(entry(&v, &holder)["cached_tokens"].as_u64() == Some(688))
            },
        )
        .await?;
        let v = route(&f.url, &body).await?;
        assert_eq!(v["order"][0], holder.as_str(), "{v}");
        let (h, o) = (entry(&v, &holder), entry(&v, &other));
        assert_eq!(
            (h["cluster_blocks"].as_u64(), h["cached_blocks"].as_u64()),
            (Some(0), Some(43)),
            "{v}"
        );
        assert_eq!(
            (o["cluster_blocks"].as_u64(), o["cached_tokens"].as_u64()),
            (Some(43), Some(688)),
            "{v}"
        );
        assert!(o["load_s"].as_f64() > h["load_s"].as_f64(), "{v}");
        assert_eq!(o["cached_blocks_by_tier"], json!([0, 0, 0]), "{v}");
        drop(f.router);
        Ok(())
    })
    .await
}

/// Two kvtier-workers sharing one kvtier server: a prompt one computed and stored, the other
/// loads from the server's DRAM, and its answer's `usage.kvtier` is what the router learns
/// that worker's DRAM bandwidth from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_learns_a_workers_load_bandwidth_from_its_answers() -> Result<()> {
    bounded(240, async {
        let dir = tempfile::tempdir()?;
        let s = KvServer::start(&dir.path().join("s"))?;
        let mut workers = Vec::new();
        let mut args: Vec<String> = vec!["--health-interval-ms".into(), "200".into()];
        for _ in 0..2 {
            let w = worker("127.0.0.1:0", &s.url(), &[])?;
            args.extend(["--worker".into(), format!("{},kvtier={}", w.1, s.url())]);
            workers.push(w);
        }
        let (_r, url) = router(&args)?;
        let (w0, w1) = (workers[0].1.clone(), workers[1].1.clone());
        let dram = |v: &Value, w: &str| entry(v, w)["measured"]["load_bytes_per_s"]["dram"].clone();
        for i in 0..3 {
            // 1000 tokens: 62 blocks, 2 MiB. Cold: both workers equal, taken in turn (the
            // first request of each pair is an even one): worker 0 computes and stores it.
            let body = completion(&text(900 + i, 1000), 2, false);
            let r = post(&format!("{url}/v1/completions"), &body).await?;
            assert_eq!(
                (r.status, answered_by(&r)),
                (200, w0.clone()),
                "{}",
                r.text()
            );
            wait_until(
                Duration::from_secs(60),
                "the prompt's blocks in the index",
                || async {
                    let v = route(&url, &body).await?;
                    Ok(entry(&v, &w1)["cached_tokens"].as_u64() == Some(992))
                },
            )
            .await?;
            // Both hold it through the shared server, equally: the repeat goes to worker 1
            // in turn, which loads the 62 blocks from the server's DRAM.
            let r = post(&format!("{url}/v1/completions"), &body).await?;
            assert_eq!(
                (r.status, answered_by(&r)),
                (200, w1.clone()),
                "{}",
                r.text()
            );
            let a = json(&r);
            assert_eq!(a["usage"]["kvtier"]["loaded_tokens"]["dram"], 992, "{a}");
            assert_eq!(
                a["usage"]["kvtier"]["loaded_bytes"]["dram"],
                62 << 15,
                "{a}"
            );
            assert!(a["usage"]["kvtier"]["load_s"].as_f64() > Some(0.0), "{a}");
        }
        let v = route(&url, &completion(&text(999, 1000), 2, false)).await?;
        let d1 = dram(&v, &w1);
        assert_eq!(
            (d1["samples"].as_u64(), d1["configured"].as_f64()),
            (Some(3), Some(2e9)),
            "{v}"
        );
        let bw = d1["measured"].as_f64().unwrap_or(0.0);
        assert!(bw > 0.0, "{v}");
        assert_eq!(
            entry(&v, &w1)["load_bytes_per_s"][1].as_f64(),
            Some(bw),
            "{v}"
        );
        assert_eq!(dram(&v, &w0)["samples"], 0, "{v}");
        let m = get(&format!("{url}/metrics")).await?.text();
        let reports = |w: &str, o: &str| load_reports(&m, w, o);
        assert_eq!(
            (reports(&w1, "dram"), reports(&w0, "nothing_loaded")),
            (3.0, 3.0),
            "{m}"
        );
        eprintln!("worker 1's DRAM load bandwidth as measured by the router: {bw:.0} B/s");
        Ok(())
    })
    .await
}
