//! Tests of the agentic benchmark against the mock endpoint (loopback, port 0).

use std::time::{Duration, Instant};

use super::driver::{self, DriveOptions, PromptFormat, TurnKind};
use super::http::{CompletionClient, Endpoint, Timeouts};
use super::mock::{Fail, MockConfig, MockServer};
use super::workload::{self, GenParams, Step};
use super::*;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Bounds a test's async part.
fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    rt().block_on(async {
        tokio::time::timeout(Duration::from_secs(secs), f)
            .await
            .expect("test ran past its time bound")
    })
}

fn small(sessions: usize, subagent_prob: f64) -> GenParams {
    GenParams {
        sessions,
        turns_min: 3,
        turns_max: 5,
        harness_tokens: 64,
        task_tokens: 32,
        tool_tokens: 24,
        output_tokens: 4,
        tool_gap_median_s: 0.002,
        tool_gap_sigma: 0.5,
        human_prob: 0.0,
        subagent_prob,
        subagents_max: 2,
        subagent_turns_max: 2,
        subagent_result_tokens: 8,
        max_context: 8192,
        ..GenParams::default()
    }
}

fn opts(concurrency: usize) -> DriveOptions {
    DriveOptions {
        concurrency,
        time_scale: 1.0,
        model: "m".into(),
        prompt_format: PromptFormat::Tokens,
        timeouts: Timeouts {
            connect: Duration::from_secs(1),
            total: Duration::from_secs(10),
        },
        api_key: None,
        max_errors: 1000,
        progress: false,
    }
}

fn ep(m: &MockServer) -> Endpoint {
    Endpoint::parse(&m.url()).unwrap()
}

fn cmp_opts(concurrency: usize) -> ComparisonOptions {
    ComparisonOptions {
        drive: opts(concurrency),
        spawn: SpawnOptions {
            worker_bin: None,
            server_bin: None,
            router_bin: None,
            seed: 1,
            model: "m".into(),
            dram_bytes: "16MiB".into(),
            nvme_dram_bytes: "8MiB".into(),
            nvme_bytes: "64MiB".into(),
            scratch_dir: std::env::temp_dir(),
            server_sets: Vec::new(),
            startup_timeout: Duration::from_secs(5),
        },
        slo_ttft_ms: 1000.0,
        slo_itl_ms: 100.0,
    }
}

#[test]
fn ttft_itl_and_e2e_follow_the_stream() {
    within(10, async {
        let m = MockServer::start(MockConfig {
            ttft_ms: 60.0,
            itl_ms: 15.0,
            prefill_us_per_token: 0.0,
            ..MockConfig::default()
        })
        .await
        .unwrap();
        let body = driver::body("m", b"hello world", 5, PromptFormat::Tokens, 3);
        let c = CompletionClient::new(&ep(&m), None, opts(1).timeouts)
            .complete(&body)
            .await
            .unwrap();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        assert_eq!(c.chunks, 5);
        assert_eq!(c.completion_tokens, Some(5));
        assert_eq!(c.prompt_tokens, Some(11));
        assert_eq!(c.cached_tokens, Some(0));
        assert!(
            ms(c.ttft) >= 60.0 && ms(c.ttft) < 400.0,
            "ttft {:?}",
            c.ttft
        );
        assert_eq!(c.itl.len(), 4);
        // A gap, or even their sum, looks short when the first chunk was delayed (the
        // mock sleeps before each chunk, so a delay shortens the gap after it); the last
        // chunk's time, TTFT plus the gaps, cannot be under the mock's 60 + 4 x 15 ms.
        let sum: Duration = c.itl.iter().sum();
        assert!(
            ms(c.ttft + sum) >= 120.0 && ms(sum) < 600.0,
            "ttft {:?}, itl {:?}",
            c.ttft,
            c.itl
        );
        assert!(c.e2e >= c.ttft + sum, "{c:?}");
        // The same prompt again: its one whole 16-token block... none (11 tokens), so a longer
        // prompt shows the cache.
        let long: Vec<u8> = (0..40u8).map(|i| b'a' + i % 26).collect();
        let body = driver::body("m", &long, 2, PromptFormat::Text, 0);
        CompletionClient::new(&ep(&m), None, opts(1).timeouts)
            .complete(&body)
            .await
            .unwrap();
        let c = CompletionClient::new(&ep(&m), None, opts(1).timeouts)
            .complete(&body)
            .await
            .unwrap();
        assert_eq!(c.cached_tokens, Some(32));
        m.with_log(|l| {
            assert_eq!(
                l.prompts[1],
                long.iter().map(|b| *b as u32).collect::<Vec<_>>()
            )
        });
    });
}

#[test]
fn closed_loop_keeps_at_most_n_sessions_and_requests_in_flight() {
    within(20, async {
        let m = MockServer::start(MockConfig {
            ttft_ms: 15.0,
            itl_ms: 1.0,
            ..MockConfig::default()
        })
        .await
        .unwrap();
        let w = workload::generate(&small(9, 0.0), 7).unwrap();
        let d = driver::drive(&w, &ep(&m), &opts(3)).await.unwrap();
        assert_eq!(d.records.len(), w.turns());
        assert!(d.records.iter().all(|r| r.outcome.is_ok()));
        assert_eq!(d.peak_sessions, 3);
        assert!(d.peak_inflight <= 3, "{}", d.peak_inflight);
        assert!(m.peak_inflight() <= 3, "{}", m.peak_inflight());
        assert!(
            m.peak_inflight() >= 2,
            "the loop never ran requests side by side"
        );
    });
}

#[test]
fn each_turn_extends_the_previous_one_and_sessions_share_the_harness() {
    within(20, async {
        let m = MockServer::start(MockConfig::default()).await.unwrap();
        let p = small(2, 0.0);
        let w = workload::generate(&p, 11).unwrap();
        let per_session = [w.sessions[0].main.turns(), w.sessions[1].main.turns()];
        driver::drive(&w, &ep(&m), &opts(1)).await.unwrap();
        m.with_log(|l| {
            assert_eq!(l.prompts.len(), per_session[0] + per_session[1]);
            let (a, b) = l.prompts.split_at(per_session[0]);
            for s in [a, b] {
                for pair in s.windows(2) {
                    assert!(pair[1].len() > pair[0].len());
                    assert_eq!(
                        &pair[1][..pair[0].len()],
                        &pair[0][..],
                        "not a prefix extension"
                    );
                }
                assert!(s.iter().flatten().all(|t| *t < 256));
            }
            let h = p.harness_tokens;
            assert_eq!(a[0][..h], b[0][..h], "sessions do not share the harness");
            assert_ne!(
                a[0][h..h + 16],
                b[0][h..h + 16],
                "sessions share their task context"
            );
        });
    });
}

#[test]
fn english_prompts_are_words_that_extend_the_previous_turn() {
    within(20, async {
        let m = MockServer::start(MockConfig::default()).await.unwrap();
        let p = small(2, 0.0);
        let w = workload::generate(&p, 11).unwrap();
        let per_session = w.sessions[0].main.turns();
        let o = DriveOptions {
            prompt_format: PromptFormat::English,
            ..opts(1)
        };
        let d = driver::drive(&w, &ep(&m), &o).await.unwrap();
        let text = |v: &Vec<u32>| String::from_utf8(v.iter().map(|b| *b as u8).collect()).unwrap();
        m.with_log(|l| {
            let (a, b) = l.prompts.split_at(per_session);
            for s in [a, b] {
                let s: Vec<String> = s.iter().map(text).collect();
                assert!(
                    s[0].starts_with("You are a coding agent"),
                    "the harness is a system prompt: {:?}",
                    &s[0][..40]
                );
                for pair in s.windows(2) {
                    assert!(pair[1].starts_with(&pair[0]), "not a prefix extension");
                    // The new part starts at a word boundary (a real tokenizer splits there).
                    assert!(pair[1][pair[0].len()..].starts_with(' '));
                }
                for t in &s {
                    assert!(
                        t.bytes().all(|c| c.is_ascii_graphic() || c == b' '),
                        "{t:?}"
                    );
                    assert!(!t.contains("  "), "empty words: {t:?}");
                }
            }
            // One word per workload token: the first prompt has the harness and the task.
            let first = text(&a[0]);
            let words = first.split(' ').count();
            let task = match &w.sessions[0].main.steps[0] {
                Step::Turn { append, .. } => append.len,
                s => panic!("a chain starts with a turn, not {s:?}"),
            };
            assert_eq!(words, p.harness_tokens + task, "{first:?}");
            let rec = d
                .records
                .iter()
                .find(|r| r.session == 0 && r.turn == 0)
                .unwrap();
            assert_eq!(rec.prompt_tokens, words);
        });
    });
}

#[test]
fn subagents_branch_off_the_parent_and_rejoin_before_it_continues() {
    within(20, async {
        let m = MockServer::start(MockConfig {
            ttft_ms: 5.0,
            ..MockConfig::default()
        })
        .await
        .unwrap();
        let mut p = small(1, 1.0);
        p.turns_min = 5;
        p.turns_max = 5;
        let w = workload::generate(&p, 3).unwrap();
        let main = &w.sessions[0].main;
        assert!(main.subagents() > 0);
        // Which main turn follows each join, and how many subagents each spawn started.
        let mut spawns = Vec::new();
        let (mut turn, mut pending) = (0usize, None);
        for s in &main.steps {
            match s {
                Step::Turn { .. } => turn += 1,
                Step::Spawn(subs) => pending = Some((turn - 1, subs.len())),
                Step::Join { .. } => {
                    if let Some((at, n)) = pending.take() {
                        spawns.push((at, n, turn));
                    }
                }
            }
        }
        assert!(!spawns.is_empty());
        let d = driver::drive(&w, &ep(&m), &opts(1)).await.unwrap();
        assert_eq!(d.records.len(), w.turns());
        let main_rec = |t: usize| {
            d.records
                .iter()
                .find(|r| r.chain == 0 && r.turn == t)
                .unwrap()
        };
        let end = |r: &driver::Record| r.start_s + r.outcome.as_ref().unwrap().e2e_ms / 1e3;
        let mut chain = 1;
        for (at, n, rejoin) in spawns {
            let spawner = main_rec(at);
            for id in chain..chain + n {
                let sub: Vec<_> = d.records.iter().filter(|r| r.chain == id).collect();
                assert!(!sub.is_empty(), "subagent {id} sent nothing");
                assert!(sub.iter().all(|r| r.kind == TurnKind::Subagent));
                assert!(
                    sub[0].start_s >= end(spawner) - 1e-3,
                    "branched before the spawn"
                );
                if rejoin < main.turns() {
                    let next = main_rec(rejoin);
                    for r in &sub {
                        assert!(
                            next.start_s >= end(r) - 1e-3,
                            "parent went on before the join"
                        );
                    }
                }
            }
            chain += n;
        }
        // Every prompt but the first extends an earlier one (a subagent its parent's context).
        m.with_log(|l| {
            for (i, p) in l.prompts.iter().enumerate().skip(1) {
                assert!(
                    l.prompts[..i]
                        .iter()
                        .any(|q| q.len() < p.len() && p[..q.len()] == q[..]),
                    "prompt {i} extends no earlier prompt"
                );
            }
        });
    });
}

#[test]
fn the_generator_is_deterministic_per_seed() {
    let p = GenParams::default();
    let a = workload::generate(&p, 1).unwrap();
    assert_eq!(a, workload::generate(&p, 1).unwrap());
    let b = workload::generate(&p, 2).unwrap();
    assert_ne!(a, b);
    assert_ne!(
        a.harness(64, workload::Content::Letters),
        b.harness(64, workload::Content::Letters)
    );
    // The defaults produce a realistic mix: subagents, long idles, growing contexts.
    assert!(a.sessions.iter().any(|s| s.main.subagents() > 0));
    let idle = a
        .sessions
        .iter()
        .flat_map(|s| &s.main.steps)
        .any(|s| matches!(s, Step::Turn { gap_s, .. } if *gap_s >= p.long_idle_s));
    assert!(idle, "no long idle gap in 16 sessions");
    let e = workload::generate(
        &GenParams {
            turns_max: 1,
            turns_min: 2,
            ..p.clone()
        },
        1,
    )
    .unwrap_err();
    assert!(e.contains("--turns-max"), "{e}");
}

#[test]
fn hot_sessions_have_long_tasks_and_more_turns_and_leave_the_rest_alone() {
    let p = GenParams {
        subagent_prob: 0.0,
        ..GenParams::default()
    };
    let plain = workload::generate(&p, 4).unwrap();
    let hot = workload::generate(
        &GenParams {
            hot_sessions: 2,
            hot_task_tokens: 3000,
            ..p.clone()
        },
        4,
    )
    .unwrap();
    let first_append = |s: &workload::Session| match &s.main.steps[0] {
        Step::Turn { append, .. } => append.len,
        other => panic!("{other:?}"),
    };
    for (i, (a, b)) in plain.sessions.iter().zip(&hot.sessions).enumerate() {
        if i < 2 {
            assert_eq!(first_append(b), 3000, "session {i}");
            assert!(b.main.turns() > a.main.turns(), "session {i}");
        } else {
            assert_eq!(a, b, "session {i} is not hot and must not change");
        }
    }
    for (bad, needle) in [
        (
            GenParams {
                hot_sessions: 17,
                ..p.clone()
            },
            "--hot-sessions",
        ),
        (
            GenParams {
                hot_sessions: 1,
                hot_task_tokens: 8000,
                ..p.clone()
            },
            "hot session",
        ),
    ] {
        let e = workload::generate(&bad, 1).unwrap_err();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn http_errors_and_bad_streams_are_counted_with_their_message() {
    let cases = [
        (
            Fail::Status(500, "engine exploded".into()),
            "HTTP 500: engine exploded",
        ),
        (
            Fail::Status(400, "prompt too long".into()),
            "HTTP 400: prompt too long",
        ),
        (Fail::MalformedSse, "malformed event data"),
        (Fail::Truncate, "without data: [DONE]"),
    ];
    for (fail, want) in cases {
        let want2 = want.to_owned();
        within(20, async move {
            let m = MockServer::start(MockConfig {
                fail: Some((fail, 2)),
                ..MockConfig::default()
            })
            .await
            .unwrap();
            let w = workload::generate(&small(2, 0.0), 5).unwrap();
            let d = driver::drive(&w, &ep(&m), &opts(2)).await.unwrap();
            let r = ConfigResult::of("x", &m.url(), Vec::new(), &d, &cmp_opts(2));
            assert_eq!(r.requests, w.turns());
            assert_eq!(r.errors, w.turns() / 2, "{want2}");
            assert_eq!(r.error_samples.len(), 1, "{:?}", r.error_samples);
            assert!(
                r.error_samples[0].0.contains(&want2),
                "{:?}",
                r.error_samples
            );
        });
    }
}

#[test]
fn too_many_errors_stop_the_run() {
    within(20, async {
        let m = MockServer::start(MockConfig {
            fail: Some((Fail::Status(503, "busy".into()), 1)),
            ..MockConfig::default()
        })
        .await
        .unwrap();
        let w = workload::generate(&small(20, 0.0), 5).unwrap();
        let mut o = opts(2);
        o.max_errors = 4;
        let d = driver::drive(&w, &ep(&m), &o).await.unwrap();
        assert!(d.records.len() < w.turns());
        assert!(d.aborted.as_deref().unwrap().contains("--max-errors 4"));
    });
}

#[test]
fn an_unreachable_endpoint_fails_fast_and_clearly() {
    within(10, async {
        // A port nobody listens on: bind, note it, close.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        let w = workload::generate(&small(2, 0.0), 5).unwrap();
        let t = Instant::now();
        let e = driver::drive(&w, &Endpoint::parse(&url).unwrap(), &opts(2))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("unreachable") && e.contains(&url), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
        // A listener that accepts but never answers: the request deadline ends it.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ep = Endpoint::parse(&format!("http://{}", l.local_addr().unwrap())).unwrap();
        let t = Instant::now();
        let e = CompletionClient::new(
            &ep,
            None,
            Timeouts {
                connect: Duration::from_millis(500),
                total: Duration::from_millis(300),
            },
        )
        .complete(b"{}")
        .await
        .unwrap_err();
        assert!(e.contains("no complete response within"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));
        drop(l);
    });
}

#[test]
fn hit_rate_is_unknown_when_the_endpoint_does_not_report_it() {
    within(20, async {
        let w = workload::generate(&small(3, 0.0), 9).unwrap();
        let m = MockServer::start(MockConfig {
            report_cached: false,
            ..MockConfig::default()
        })
        .await
        .unwrap();
        let d = driver::drive(&w, &ep(&m), &opts(2)).await.unwrap();
        let r = ConfigResult::of("x", "u", Vec::new(), &d, &cmp_opts(2));
        assert_eq!(r.prefix_hit_rate, None);
        let m = MockServer::start(MockConfig::default()).await.unwrap();
        let d = driver::drive(&w, &ep(&m), &opts(1)).await.unwrap();
        let r = ConfigResult::of("x", "u", Vec::new(), &d, &cmp_opts(1));
        // One session at a time: the mock's unlimited cache reuses exactly what the driver
        // counts as reusable.
        let hit = r.prefix_hit_rate.unwrap();
        assert!(hit > 0.3, "{hit}");
        assert!(
            (hit - r.reusable_share).abs() < 1e-9,
            "{hit} vs {}",
            r.reusable_share
        );
    });
}

#[test]
fn comparison_puts_configurations_side_by_side() {
    let w = workload::generate(&small(4, 0.3), 21).unwrap();
    let targets = vec![
        TargetSpec::parse_target("off=mock://?cache=off&prefill_us_per_token=200").unwrap(),
        TargetSpec::parse_target("on=mock://?prefill_us_per_token=200").unwrap(),
    ];
    let t = Instant::now();
    let c = run_comparison(&w, &targets, &cmp_opts(2)).unwrap();
    assert!(t.elapsed() < Duration::from_secs(20));
    assert_eq!(c.configs.len(), 2);
    let (off, on) = (&c.configs[0], &c.configs[1]);
    assert_eq!(off.errors + on.errors, 0);
    assert_eq!(off.prefix_hit_rate, Some(0.0));
    assert!(on.prefix_hit_rate.unwrap() > 0.3);
    assert!(on.ttft_warm_ms.p50.unwrap() < off.ttft_warm_ms.p50.unwrap());
    let tables = c.tables();
    let cmp = &tables[1];
    assert_eq!(cmp.columns, ["metric", "off", "on", "on/off"]);
    let row = |name: &str| {
        cmp.rows
            .iter()
            .find(|r| r[0] == name)
            .unwrap_or_else(|| panic!("no row {name}"))
            .clone()
    };
    assert_eq!(row("requests")[1], w.turns().to_string());
    assert_eq!(row("requests")[3], "1.00x");
    assert!(row("TTFT warm turn p50")[3].ends_with('x'));
    let plots = c.plots();
    assert_eq!(plots.len(), 2);
    assert!(plots[1].svg().contains(">on<"));
    let e = TargetSpec::parse_target("x=mock://?cache=maybe").unwrap_err();
    assert!(e.contains("expected on or off"), "{e}");
    // A configuration that cannot be reached gets a FAILED column; the others still run.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("dead=http://{}", l.local_addr().unwrap());
    drop(l);
    let with_dead = vec![TargetSpec::parse_target(&dead).unwrap(), targets[1].clone()];
    let c = run_comparison(&w, &with_dead, &cmp_opts(2)).unwrap();
    assert!(
        c.configs[0]
            .failed
            .as_deref()
            .unwrap()
            .contains("unreachable")
    );
    assert!(c.configs[1].failed.is_none() && c.configs[1].errors == 0);
    assert!(c.failures().unwrap_err().to_string().contains("\"dead\""));
    let t = &c.tables()[1];
    assert_eq!(t.rows[0][1], "-");
    assert!(
        c.tables()[2]
            .rows
            .iter()
            .any(|r| r[0].starts_with("dead: FAILED: "))
    );
    let all_dead = run_comparison(&w, &with_dead[..1], &cmp_opts(1))
        .unwrap_err()
        .to_string();
    assert!(all_dead.contains("unreachable"), "{all_dead}");
    let dup = run_comparison(&w, &[targets[0].clone(), targets[0].clone()], &cmp_opts(1))
        .unwrap_err()
        .to_string();
    assert!(dup.contains("given twice"), "{dup}");
}

/// The reader is the workspace's one (`crate::trace`, whose own tests cover its errors): its
/// errors reach the agentic run naming the file and the entry.
#[test]
fn claude_trace_errors_name_the_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let tp = trace::TraceParams {
        token_scale: 1.0,
        max_context: 8192,
        max_output: 256,
        long_idle_s: 20.0,
        sessions: None,
    };
    let check = |text: &str, want: &str| {
        let f = tmp.path().join("t.json");
        std::fs::write(&f, text).unwrap();
        let e = format!("{:#}", trace::load(&[f], &tp, 1).unwrap_err());
        assert!(e.contains("t.json") && e.contains(want), "{text}: {e}");
    };
    check("{\"requests\": [\n{\"t\": 0,}]}", "t.json:2:");
    check("{\"block_size\": 64}", "no `requests` list");
    check(
        r#"{"block_size": 64, "requests": [{"t": 0, "type": "n", "in": 64, "out": 1, "hash_ids": [1]}, {"t": 1, "type": "n", "out": 2, "hash_ids": []}]}"#,
        "requests[1]: no `in`",
    );
    check(
        r#"{"block_size": 64, "requests": [{"t": 0, "type": "n", "in": 64, "out": 1, "hash_ids": [1]}, {"type": "subagent", "t": 2, "requests": [{"t": 0, "type": "n", "in": 64, "out": "x", "hash_ids": [2]}]}]}"#,
        "t.json: requests[1].requests[0]: invalid type: string \"x\", expected u64",
    );
    check(
        r#"{"block_size": 64, "requests": [{"type": "subagent", "t": 2, "requests": []}]}"#,
        "no model calls",
    );
    let e = trace::load(&[tmp.path().join("absent.json")], &tp, 1).unwrap_err();
    assert!(format!("{e:#}").contains("absent.json"), "{e:#}");
}

#[test]
fn claude_traces_map_onto_growing_sessions() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/claude-code-sample");
    let tp = trace::TraceParams {
        token_scale: 0.05,
        max_context: 8192,
        max_output: 256,
        long_idle_s: 20.0,
        sessions: None,
    };
    assert!(dir.is_dir(), "{} is missing", dir.display());
    {
        let w = trace::load(std::slice::from_ref(&dir), &tp, 1).unwrap();
        assert_eq!(w.sessions.len(), 6);
        assert!(w.turns() >= 6);
        assert!(w.sessions.iter().any(|s| s.main.subagents() > 0));
        assert_eq!(w, trace::load(std::slice::from_ref(&dir), &tp, 1).unwrap());
    }
    // A small trace written here: two calls, a subagent between them, a call too long.
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("s.json");
    // 512-token blocks: a call of `in` tokens has in / 512 hash ids.
    let call = |t: u64, input: u64, out: u64, think: u64| {
        serde_json::json!({"t": t, "type": "n", "in": input, "out": out, "think_time": think,
                           "hash_ids": (0..input / 512).collect::<Vec<u64>>()})
    };
    let doc = serde_json::json!({"block_size": 512, "system_tokens": 2000, "tool_tokens": 2000,
        "requests": [
            call(0, 6000, 100, 0),
            {"type": "subagent", "t": 5, "duration_ms": 1000, "system_tokens": 1000,
             "tool_tokens": 0, "requests": [call(0, 3000, 40, 0), call(1, 4000, 60, 1)]},
            call(10, 9000, 100, 30),
            call(50, 900_000, 100, 3)]});
    std::fs::write(&f, doc.to_string()).unwrap();
    let w = trace::load(&[f], &tp, 1).unwrap();
    let s = &w.sessions[0].main;
    assert_eq!(s.base, workload::Base::Harness(200));
    assert_eq!(w.truncated_turns, 1);
    let kinds: Vec<&str> = s
        .steps
        .iter()
        .map(|s| match s {
            Step::Turn { .. } => "turn",
            Step::Spawn(_) => "spawn",
            Step::Join { .. } => "join",
        })
        .collect();
    assert_eq!(kinds, ["turn", "spawn", "join", "turn"]);
    match (&s.steps[0], &s.steps[3]) {
        (
            Step::Turn {
                append: a0,
                max_tokens: 5,
                ..
            },
            Step::Turn {
                gap_s, append: a1, ..
            },
        ) => {
            assert_eq!(a0.len, 100); // 300 scaled - 200 harness
            assert_eq!(*gap_s, 30.0);
            assert_eq!(a1.len, 450 - 300 - 3); // minus the subagent's result (60 scaled)
        }
        other => panic!("{other:?}"),
    }
}

/// What the shared Claude Code samples give under two seeds and two scales, as digests of the
/// workloads: a change to the trace reader or the mapping must not change what a seed produces.
#[test]
fn the_sample_traces_give_the_same_workloads_as_before() {
    let dir = crate::trace::shared_traces_dir().join("claude-code-sample");
    assert!(dir.is_dir(), "{} is missing", dir.display());
    let digest = |scale: f64, seed: u64| {
        let tp = trace::TraceParams {
            token_scale: scale,
            max_context: 8192,
            max_output: 256,
            long_idle_s: 20.0,
            sessions: Some(8),
        };
        let w = trace::load(std::slice::from_ref(&dir), &tp, seed).unwrap();
        let text = format!(
            "{:?} {:?} {}",
            w.sessions, w.harness_seed, w.truncated_turns
        );
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    };
    // Recorded with the trace's own reader, before it was replaced by the one in `crate::trace`.
    assert_eq!(
        [digest(0.05, 1), digest(0.2, 7)],
        [0x18c7_c32a_8da2_1bf1, 0x482d_a9ae_81d3_6401]
    );
}
