//! End to end: `kvtier-bench tiers --quick` on loopback, without Redis, in bounded time.

use std::process::Command;
use std::time::Duration;

use kvtier_testkit::process::run_bounded;

/// A debug build of the quick mode takes seconds; this bounds a hang.
const LIMIT: Duration = Duration::from_secs(180);

/// Runs kvtier-bench with `args`; returns (stdout, stderr), or fails after [`LIMIT`].
fn bench(args: &[&str]) -> (String, String) {
    let f = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_kvtier-bench")).args(args),
        LIMIT,
    )
    .unwrap();
    assert!(
        f.status.success(),
        "kvtier-bench {args:?}: {}\n{}",
        f.status,
        f.stderr
    );
    (f.stdout, f.stderr)
}

/// `kvtier-bench --json tiers --quick --no-redis --parts server` with `args`, its data in
/// `data`: the JSON document.
fn server_json(data: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec![
        "--json",
        "tiers",
        "--quick",
        "--no-redis",
        "--parts",
        "server",
    ];
    all.extend_from_slice(args);
    all.extend(["--dir", data.to_str().unwrap()]);
    let (json, _) = bench(&all);
    serde_json::from_str(&json).unwrap()
}

#[test]
fn tiers_quick_runs_every_path_and_says_redis_was_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let plots = dir.path().join("plots");
    let (text, _) = bench(&[
        "--seed",
        "42",
        "--plots",
        plots.to_str().unwrap(),
        "tiers",
        "--quick",
        "--no-redis",
        "--dir",
        data.to_str().unwrap(),
    ]);
    assert!(text.contains("seed: 42"), "{text}");
    assert!(text.contains("SKIPPED: --no-redis"), "{text}");
    for path in [
        "kvtier dram, in-process",
        "kvtier nvme tier, in-process",
        "kvtier dram, unix zero-copy",
        "kvtier dram, tcp",
        "kvtier dram, quic",
        "kvtier nvme, unix zero-copy",
        "kvtier nvme, tcp",
        "O_DIRECT pread",
        "came from NVMe",
        "raw loopback TCP",
        "raw quinn",
        "memcpy",
    ] {
        assert!(text.contains(path), "no {path:?} in\n{text}");
    }
    assert!(text.contains("ratios"), "{text}");
    let svgs: Vec<_> = std::fs::read_dir(&plots)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    for f in [
        "tiers-get-gbps.svg",
        "tiers-put-gbps.svg",
        "tiers-get-ratios.svg",
        "tiers-put-ratios.svg",
        "tiers-get-server-p99.svg",
        "tiers-put-store-p50.svg",
    ] {
        assert!(svgs.iter().any(|s| s == f), "{f} not in {svgs:?}");
    }

    // The same run as JSON: every kvtier row moved bytes and has latency percentiles, and
    // every comparison has a ratio.
    let doc = server_json(&data, &["--transports", "unix,tcp"]);
    assert_eq!(doc["benchmark"], "tiers");
    assert!(doc["seed"].is_u64());
    assert_eq!(doc["result"]["redis"], "SKIPPED: --no-redis");
    let rows = doc["result"]["rows"].as_array().unwrap();
    let kv: Vec<_> = rows.iter().filter(|r| r["kvtier"] == true).collect();
    // dram and nvme, unix and tcp, get and put, one client count.
    assert_eq!(kv.len(), 8, "{rows:?}");
    for r in rows {
        assert!(r["gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
        let (p50, p99) = (
            r["latency_us_p50"].as_f64().unwrap(),
            r["latency_us_p99"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p99 >= p50, "{r}");
    }
    let comparisons = doc["result"]["comparisons"].as_array().unwrap();
    // dram: unix against memcpy, tcp against raw TCP; nvme: both against O_DIRECT; get and
    // put each.
    assert_eq!(comparisons.len(), 8, "{comparisons:?}");
    for c in comparisons {
        assert!(c["ratio"].as_f64().unwrap() > 0.0, "{c}");
    }
    // The lookup: in process; over the Unix socket answered in place (the default) and with
    // a round trip each, each closed loop and paced, with 1 client and with 4; and the same
    // bytes over a bare socket pair, 1 and 4 at once (the floor).
    let lookup = &doc["result"]["server"]["lookup"];
    assert!(lookup["ping_us_p50"].as_f64().unwrap() > 0.0, "{lookup}");
    let cases = lookup["cases"].as_array().unwrap();
    let shape: Vec<(&str, u64, Option<u64>)> = cases
        .iter()
        .map(|c| {
            (
                c["path"].as_str().unwrap(),
                c["clients"].as_u64().unwrap(),
                c["rate_per_client"].as_u64(),
            )
        })
        .collect();
    let mut want = vec![("in process", 1, None)];
    for path in ["unix socket", "unix socket, a round trip each"] {
        for rate in [None, Some(1000)] {
            want.extend([(path, 1, rate), (path, 4, rate)]);
        }
    }
    want.extend([
        ("raw unix socket, same bytes", 1, None),
        ("raw unix socket, same bytes", 4, None),
    ]);
    assert_eq!(shape, want, "{lookup}");
    assert_eq!(lookup["tenants"], false, "{lookup}");
    assert_eq!(lookup["dram_blocks"], 1024, "{lookup}");

    // In a tenant's namespace, on a DRAM tier of 400 slots: the local engine maps its keys
    // as the server does, so its lookups are answered in place (the bench fails a run in
    // which none is).
    let doc = server_json(
        &data,
        &[
            "--transports",
            "unix",
            "--server-tiers",
            "dram",
            "--lookup-tenants",
            "--lookup-dram-blocks",
            "400",
        ],
    );
    let lookup = &doc["result"]["server"]["lookup"];
    assert_eq!(lookup["tenants"], true, "{lookup}");
    assert_eq!(lookup["dram_blocks"], 400, "{lookup}");
    let in_place: u64 = lookup["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["path"] == "unix socket")
        .map(|c| c["in_place"].as_u64().unwrap())
        .sum();
    assert!(in_place > 0, "{lookup}");
    // The prefix is all in DRAM: answered in place where the switch is on (every lookup:
    // nothing is being stored meanwhile), never where it is off.
    for c in cases {
        let (n, in_place) = (
            c["lookups"].as_u64().unwrap(),
            c["in_place"].as_u64().unwrap(),
        );
        let want = if c["path"] == "unix socket" { n } else { 0 };
        assert_eq!(in_place, want, "{c}");
    }
    for c in cases {
        let (p50, p99) = (
            c["latency_us_p50"].as_f64().unwrap(),
            c["latency_us_p99"].as_f64().unwrap(),
        );
        assert!(c["lookups"].as_u64().unwrap() >= 10, "{c}");
        assert!(p50 > 0.0 && p99 >= p50, "{c}");
    }
}
