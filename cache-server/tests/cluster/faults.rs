//! The randomized fault test: agent-like sessions (growing chains of checksummed blocks)
//! looked up, read and extended on three members at random while, one at a time, a member is
//! killed (SIGKILL) and restarted on its warm NVMe tier, a member hangs (SIGSTOP: its peers
//! and etcd hear nothing, as in a partition) and goes on, and etcd is killed and restarted.
//! It counts hits, misses and wrong bytes: wrong bytes must be 0, every call must end within
//! its deadline, and the cluster must converge afterwards. The schedule is drawn from a seed
//! (`KVTIER_FAULT_SEED`, else a fixed one) printed first, so a failure replays.

use std::time::{Duration, Instant};

use kvtier_client::{Client, ClientConfig, Miss};
use kvtier_core::BlockKey;

use super::common::{BLOCK, ServerProc, TOKEN, block_data, bounded, http_get, keys};
use super::data_path::RUN;
use super::{member_with, metric, secret_file, until_view};
use kvtier_testkit::etcd::Etcd;

const SECRET: &str = "the fault test's secret, 32 byte";
const IDS: [&str; 3] = ["a", "b", "c"];
/// How long faults are injected.
const FAULTS_FOR: Duration = Duration::from_secs(24);
/// Sessions, and the blocks each grows to.
const SESSIONS: usize = 16;
const CHAIN: usize = 8 * RUN;
/// Between requests (a paced client, so the faults meet traffic of every kind).
const PACE: Duration = Duration::from_millis(5);
/// The most any call may take (the client's own deadline is 5 s; a peer's, 300 ms).
const CALL_BOUND: Duration = Duration::from_secs(4);

/// splitmix64: the schedule's random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.next() % (to - from))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// SIGKILL a member; start it again on its directory when the fault ends.
    Kill(usize),
    /// SIGSTOP a member; SIGCONT when the fault ends.
    Hang(usize),
    /// SIGKILL etcd; start it again on its data when the fault ends.
    Etcd,
}

struct Node {
    proc: Option<ServerProc>,
    client: Option<Client>,
    hung: bool,
}

#[derive(Default, Debug)]
struct Counts {
    calls: u64,
    hits: u64,
    misses: u64,
    wrong: u64,
    put_blocks: u64,
    failed_calls: u64,
    slowest: Duration,
    faults: Vec<Fault>,
}

fn member(etcd: &Etcd, id: &str, secret: &str) -> ServerProc {
    let extra = [
        "cluster.run_blocks=8",
        "cluster.head_blocks=0",
        "cluster.peer_timeout_ms=300",
        "store.dram_bytes=\"2MiB\"",
        // One-sided reads of the owners' DRAM (members talk TLS, where `auto` would fetch
        // over the protocol): kills and hangs land in the middle of reads too.
        "cluster.fetch=\"tcp\"",
    ];
    member_with(etcd, id, 3, secret, &extra)
}

/// Times `f`, records it as the slowest call if it is, and checks it ended within the bound.
async fn call<T>(n: &mut Counts, f: impl std::future::Future<Output = T>) -> T {
    let t0 = Instant::now();
    let out = tokio::time::timeout(CALL_BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("a call took more than {CALL_BOUND:?}: {n:?}"));
    n.calls += 1;
    n.slowest = n.slowest.max(t0.elapsed());
    out
}

/// Reads `chain` (blocks a lookup found) on `cl`; counts hits and wrong bytes.
async fn read(n: &mut Counts, cl: &Client, chain: &[BlockKey]) -> usize {
    let mut bufs: Vec<Vec<u8>> = chain.iter().map(|_| vec![0u8; BLOCK]).collect();
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let f = call(n, cl.get_into(chain, &mut dst)).await;
    for (k, b) in chain.iter().zip(&bufs).take(f.blocks) {
        if *b != block_data(*k) {
            n.wrong += 1;
        }
    }
    n.hits += f.blocks as u64;
    f.blocks
}

/// One request of a session on `cl`: look up its chain (`known` blocks stored before, then
/// new ones), read what is found, store the rest (as an engine stores what it computed).
/// Known blocks not found count as misses.
async fn request(n: &mut Counts, cl: &Client, chain: &[BlockKey], known: usize) {
    let l = call(n, cl.lookup(chain)).await;
    let found = read(n, cl, &chain[..l.tiers.len()]).await;
    n.misses += known.saturating_sub(found) as u64;
    if found < l.tiers.len() || !matches!(l.miss, None | Some(Miss::NotCached)) {
        n.failed_calls += 1;
    }
    let rest = &chain[found..];
    let data: Vec<Vec<u8>> = rest.iter().map(|k| block_data(*k)).collect();
    let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let parent = found.checked_sub(1).map(|p| chain[p]);
    let s = call(n, cl.put_chain(rest, parent, &bufs)).await;
    if s.failure.is_some() {
        n.failed_calls += 1;
    }
    n.put_blocks += s.cached() as u64;
}

async fn connect(s: &ServerProc) -> Option<Client> {
    let cfg = ClientConfig::default().token(TOKEN);
    Client::connect(&s.tcp_url(), cfg).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kills_hangs_and_etcd_restarts_never_serve_a_wrong_byte() {
    let seed = std::env::var("KVTIER_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x6b76_7469_6572);
    println!("KVTIER_FAULT_SEED={seed}");
    bounded(150, async move {
        // The faults draw from their own stream, so how many requests run between them (which
        // depends on the machine's speed) does not change which faults come.
        let mut rng = Rng(seed);
        let mut faults = Rng(seed ^ 0x5eed);
        let mut etcd = Etcd::start().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(dir.path(), SECRET);
        let mut nodes: Vec<Node> = IDS
            .iter()
            .map(|id| Node {
                proc: Some(member(&etcd, id, &secret)),
                client: None,
                hung: false,
            })
            .collect();
        for node in &nodes {
            until_view(node.proc.as_ref().unwrap(), &IDS, Duration::from_secs(20)).await;
        }
        let chains: Vec<Vec<BlockKey>> = (0..SESSIONS)
            .map(|i| keys(format!("fault-{i}").as_bytes(), CHAIN, i as u32))
            .collect();
        let mut progress = [0usize; SESSIONS];
        let mut n = Counts::default();
        let mut fault: Option<(Fault, Instant)> = None;
        let mut kinds = [0, 1, 2];
        let mut next_fault = Instant::now() + Duration::from_secs(1);
        let t0 = Instant::now();
        while t0.elapsed() < FAULTS_FOR {
            // End the fault whose time has come, or start the next one.
            match fault {
                Some((f, until)) if Instant::now() >= until => {
                    match f {
                        Fault::Kill(i) => {
                            let p = nodes[i].proc.take().unwrap();
                            nodes[i].proc = Some(p.kill_and_start_again());
                            nodes[i].client = None;
                            nodes[i].hung = false;
                        }
                        Fault::Hang(i) => {
                            nodes[i].proc.as_ref().unwrap().signal(libc::SIGCONT);
                            nodes[i].hung = false;
                        }
                        Fault::Etcd => etcd.restart().await,
                    }
                    fault = None;
                    next_fault = Instant::now() + faults.millis(500, 1500);
                }
                None if Instant::now() >= next_fault => {
                    // Each round of three has one fault of each kind, in a random order.
                    let round = n.faults.len() % 3;
                    if round == 0 {
                        kinds.swap(0, faults.below(3));
                        kinds.swap(1, 1 + faults.below(2));
                    }
                    let node = faults.below(IDS.len());
                    let f = match kinds[round] {
                        0 => Fault::Kill(node),
                        1 => Fault::Hang(node),
                        _ => Fault::Etcd,
                    };
                    match f {
                        Fault::Kill(i) => {
                            // Killed now; started again when the fault ends.
                            nodes[i].proc.as_ref().unwrap().signal(libc::SIGKILL);
                            nodes[i].client = None;
                            nodes[i].hung = true;
                        }
                        Fault::Hang(i) => {
                            nodes[i].proc.as_ref().unwrap().signal(libc::SIGSTOP);
                            nodes[i].hung = true;
                        }
                        Fault::Etcd => etcd.kill(),
                    }
                    n.faults.push(f);
                    fault = Some((f, Instant::now() + faults.millis(1000, 4000)));
                }
                _ => {}
            }
            // A request of a random session on a random member that answers.
            let i = rng.below(IDS.len());
            if nodes[i].hung {
                continue;
            }
            if nodes[i].client.is_none() {
                nodes[i].client = connect(nodes[i].proc.as_ref().unwrap()).await;
            }
            let Some(cl) = &nodes[i].client else {
                n.failed_calls += 1;
                continue;
            };
            let s = rng.below(SESSIONS);
            let known = progress[s];
            progress[s] = (progress[s] + 1 + rng.below(RUN)).min(CHAIN);
            request(&mut n, cl, &chains[s][..progress[s]], known).await;
            tokio::time::sleep(PACE).await;
        }
        // Heal: end the last fault, then every member sees every other again.
        if let Some((f, _)) = fault {
            match f {
                Fault::Kill(i) => {
                    let p = nodes[i].proc.take().unwrap();
                    nodes[i].proc = Some(p.kill_and_start_again());
                }
                Fault::Hang(i) => nodes[i].proc.as_ref().unwrap().signal(libc::SIGCONT),
                Fault::Etcd => etcd.restart().await,
            }
        }
        for node in &nodes {
            until_view(node.proc.as_ref().unwrap(), &IDS, Duration::from_secs(20)).await;
        }
        // Every member reads every session's chain again: whatever it serves is exact.
        let during = (n.hits, n.misses);
        for node in &nodes {
            let cl = connect(node.proc.as_ref().unwrap()).await.unwrap();
            for (s, chain) in chains.iter().enumerate() {
                let l = call(&mut n, cl.lookup(&chain[..progress[s]])).await;
                let found = read(&mut n, &cl, &chain[..l.tiers.len()]).await;
                n.misses += (progress[s] - found) as u64;
            }
        }
        let (mut remote, mut reads) = (0.0, 0.0);
        for node in &nodes {
            let m = http_get(node.proc.as_ref().unwrap().admin, "/metrics").await.1;
            remote += metric(&m, "kvtier_cluster_remote_hits_total");
            reads += m
                .lines()
                .filter(|l| {
                    l.starts_with("kvtier_cluster_peer_requests_total{") && l.contains("op=\"read\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
        }
        assert!(reads > 0.0, "no one-sided read since the last starts");
        println!(
            "{n:?}; during the faults {} hits, {} misses; remote hits since the last starts {remote}",
            during.0, during.1
        );
        assert!(remote > 0.0, "the members never read from each other");
        assert_eq!(n.wrong, 0, "wrong bytes served: {n:?}");
        for kind in [Fault::Kill(0), Fault::Hang(0), Fault::Etcd] {
            assert!(
                n.faults
                    .iter()
                    .any(|f| std::mem::discriminant(f) == std::mem::discriminant(&kind)),
                "the schedule never injected {kind:?}: {n:?}"
            );
        }
        assert!(n.hits > 0 && n.put_blocks > 0, "{n:?}");
        // After healing, the cluster serves: at least what was stored is found somewhere.
        assert!(n.hits > during.0, "nothing found after healing: {n:?}");
    })
    .await;
}
