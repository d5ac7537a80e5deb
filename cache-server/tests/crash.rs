//! Crash and reopen: a child process writing blocks is killed with SIGKILL at random moments;
//! after each kill the store is reopened and checked against what the child recorded:
//! every block it reported durable is present with its exact bytes, every present block has
//! its exact bytes, and nothing that was never written appears.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use kvtier_core::SplitMix64;
use kvtier_server::{GetOutcome, TieredStore};

const ROUNDS: u64 = 16;
const ROUND_KEYS: u64 = 1_000_000;
const NVME_SLOTS: u64 = 512;
/// The newest durable keys that must survive (NVMe evicts its oldest blocks first).
const MUST_SURVIVE: u64 = 128;
const CHILD_ENV: &str = "KVTIER_CRASH_CHILD_DIR";

const TIERS_ENV: &str = "KVTIER_CRASH_TIERS";

fn open(dir: &Path, tiers: Tiers) -> (TieredStore, kvtier_server::OpenReport) {
    TieredStore::open(config_tiers(tiers, 8, (dir, NVME_SLOTS), 4)).unwrap()
}

/// The child's work: write keys until killed, flushing every four, and after each flush
/// append the last durable key index to `durable-<round>`.
fn child(dir: &Path, round: u64, tiers: Tiers) {
    let (s, _) = open(&dir.join("store"), tiers);
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("durable-{round}")))
        .unwrap();
    for i in 0..ROUND_KEYS {
        let k = key(round * ROUND_KEYS + i);
        s.put(k, None, &data(k)).unwrap();
        if i % 4 == 3 {
            s.flush();
            writeln!(log, "{i}").unwrap();
        }
    }
}

#[test]
fn killed_writer_never_leaves_torn_or_stale_blocks() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        let round = std::env::var("KVTIER_CRASH_ROUND")
            .unwrap()
            .parse()
            .unwrap();
        let tiers = match std::env::var(TIERS_ENV).as_deref() {
            Ok("hbm") => Tiers::HbmDramNvme,
            _ => Tiers::DramNvme,
        };
        child(Path::new(&dir), round, tiers);
        return;
    }
    // Every tier list with NVMe (a crash loses the volatile tiers; NVMe must be intact).
    for tiers in [Tiers::DramNvme, Tiers::HbmDramNvme] {
        crash_rounds(tiers);
    }
}

fn crash_rounds(tiers: Tiers) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix64::new(2026);
    let mut recovered_total = 0;
    for round in 0..ROUNDS {
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args([
                "killed_writer_never_leaves_torn_or_stale_blocks",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD_ENV, dir.path())
            .env("KVTIER_CRASH_ROUND", round.to_string())
            .env(TIERS_ENV, if tiers.has_hbm() { "hbm" } else { "" })
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(10 + rng.below(400)));
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
        c.wait().unwrap();

        let (s, report) = open(&dir.path().join("store"), tiers);
        let nvme = report.nvme.unwrap();
        assert_eq!(nvme.cold_start, None);
        recovered_total += nvme.recovered;
        let durable: Vec<u64> =
            std::fs::read_to_string(dir.path().join(format!("durable-{round}")))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.parse().ok())
                .collect();
        let last = durable.last().copied();
        let base = round * ROUND_KEYS;
        if let Some(last) = last {
            // The newest durable keys are the newest on NVMe, so none was evicted.
            for i in last.saturating_sub(MUST_SURVIVE - 1)..=last {
                assert!(
                    matches!(get(&s, key(base + i)), GetOutcome::Hit(_)),
                    "round {round}: durable key {i} (last durable {last}) lost"
                );
            }
        }
        // Every present block has its exact bytes (checked inside `get`): this round's,
        // including the ones written after the last flush, and a sample of older rounds'.
        for i in 0..last.map_or(64, |l| l + 64) {
            get(&s, key(base + i));
        }
        for r in 0..round {
            for i in 0..64 {
                get(&s, key(r * ROUND_KEYS + i));
            }
        }
        // Keys never written are absent.
        for i in 0..16 {
            let never = key(base + ROUND_KEYS - 1 - i);
            assert!(
                !matches!(get(&s, never), GetOutcome::Hit(_)),
                "never-written key present"
            );
        }
        // A write torn by the kill may show up as a corrupt block: that is a counted miss.
        let st = s.stats();
        let corrupt = st
            .tier(kvtier_server::TierKind::Nvme)
            .unwrap()
            .corrupt_dropped;
        eprintln!(
            "{tiers:?} round {round}: recovered {}, durable up to {last:?}, corrupt {corrupt}",
            nvme.recovered
        );
        s.check_consistency().unwrap();
        drop(s);
        std::io::stderr().flush().unwrap();
    }
    assert!(
        recovered_total > 0,
        "no round recovered anything: kills came too early"
    );
}
