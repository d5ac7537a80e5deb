//! The replay's server side: an embedded server (started in this process, reached over its
//! Unix socket) or one at an address, served through kvtier-client; the server's statistics.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvtier_client::{Client, ClientConfig, Miss, PutStatus};
use kvtier_core::{BlockKey, KvLayout};
use kvtier_server::server::{ConfigLoader, Server};

use super::payload::{self, HEADER_BYTES};
use super::schedule::{Backend, Served};
use crate::util;

/// How long connecting to a server may take before the replay gives up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Serves requests through a client: lookup, load and verify the hit prefix, store the rest.
pub struct ClientBackend {
    client: Client,
    block_bytes: usize,
    lookup_only: bool,
}

impl ClientBackend {
    /// With `lookup_only`, hits are what the lookup reports and nothing is loaded (nor
    /// verified): the request pattern of the store's simulator.
    pub fn new(client: Client, lookup_only: bool) -> Result<Self> {
        let block_bytes = client.block_bytes();
        if block_bytes < HEADER_BYTES {
            bail!(
                "the server's blocks are {block_bytes} bytes; the replay needs at least {HEADER_BYTES} \
                 for its checksum and key"
            );
        }
        Ok(Self {
            client,
            block_bytes,
            lookup_only,
        })
    }
}

/// How a fleet's request picks its server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Route {
    /// The next server, in turn.
    RoundRobin,
    /// A hash of the prompt's first two block keys: every call of a session (or every turn
    /// of a conversation behind a shared system prompt) on one server, as a session-sticky
    /// router sends them.
    Session,
}

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Route::RoundRobin => "round robin",
            Route::Session => "session",
        }
    }
}

/// How long a fleet with failover passes over a server that failed a request (as a router
/// takes a worker out until its health check passes); then it is tried again.
pub const DOWN_FOR: Duration = Duration::from_secs(1);

/// Several servers behind one [`Backend`]: each request is served whole by one of them.
pub struct Fleet {
    members: Vec<ClientBackend>,
    route: Route,
    next: AtomicUsize,
    /// Failover on: until when each member is passed over after a failure.
    down_until: Option<Vec<Mutex<Option<Instant>>>>,
}

impl Fleet {
    /// `members` must not be empty. Without failover, a request the picked server fails
    /// stops the replay.
    pub fn new(members: Vec<ClientBackend>, route: Route) -> Self {
        assert!(!members.is_empty(), "a fleet of no servers");
        Self {
            members,
            route,
            next: AtomicUsize::new(0),
            down_until: None,
        }
    }

    /// With `on`, a request whose server fails it (gone, refusing, timing out) is served by
    /// the next server instead, as a router retries on the next worker, and the failed one
    /// is passed over for [`DOWN_FOR`]; the replay stops only when every server fails one
    /// request.
    pub fn failover(mut self, on: bool) -> Self {
        self.down_until = on.then(|| self.members.iter().map(|_| Mutex::new(None)).collect());
        self
    }

    /// The members to try for a request picked for `first`: it, then the others in turn,
    /// those passed over now left out (unless every one is).
    fn attempts(&self, first: usize, down: &[Mutex<Option<Instant>>]) -> Vec<usize> {
        let n = self.members.len();
        let order: Vec<usize> = (0..n).map(|a| (first + a) % n).collect();
        let now = Instant::now();
        let up: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| {
                !down[i]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_some_and(|t| now < t)
            })
            .collect();
        if up.is_empty() { order } else { up }
    }

    /// The member that serves a request for `keys`.
    pub fn pick(&self, keys: &[BlockKey]) -> usize {
        match self.route {
            Route::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % self.members.len(),
            Route::Session => self.session_member(keys),
        }
    }

    /// The member a session's requests go to, by a hash of their first two block keys.
    fn session_member(&self, keys: &[BlockKey]) -> usize {
        // Block keys are cryptographic hashes already: their bytes are uniform.
        let x = keys.iter().take(2).fold(0u64, |x, k| {
            let b: [u8; 8] = k.as_bytes()[..8].try_into().expect("8 of 16 bytes");
            x.rotate_left(29) ^ u64::from_le_bytes(b)
        });
        (x % self.members.len() as u64) as usize
    }
}

impl Backend for Fleet {
    async fn serve(&self, keys: Vec<BlockKey>, blocks_to_store: usize) -> Result<Served> {
        let first = self.pick(&keys);
        let Some(down) = &self.down_until else {
            return self.members[first].serve(keys, blocks_to_store).await;
        };
        let mut errors = 0;
        let mut last = None;
        for i in self.attempts(first, down) {
            match self.members[i].serve(keys.clone(), blocks_to_store).await {
                Ok(mut s) => {
                    s.rerouted = i != first;
                    s.server_errors = errors;
                    return Ok(s);
                }
                Err(e) => {
                    *down[i].lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(Instant::now() + DOWN_FOR);
                    errors += 1;
                    last = Some(e.context(format!("server {i}")));
                }
            }
        }
        Err(last
            .expect("a fleet has a member")
            .context("every server of the fleet failed the request"))
    }

    /// To the session's member; under round robin, where the next request goes is not
    /// known: to every member (those not holding the prefix answer "nothing cached").
    async fn retain(
        &self,
        session: u64,
        keys: Vec<BlockKey>,
        expected_return: Duration,
    ) -> Result<bool> {
        let members: Vec<usize> = match self.route {
            Route::Session => vec![self.session_member(&keys)],
            Route::RoundRobin => (0..self.members.len()).collect(),
        };
        let mut accepted = false;
        for i in members {
            match self.members[i]
                .retain(session, keys.clone(), expected_return)
                .await
            {
                Ok(a) => accepted |= a,
                // With failover, a server that is down misses the hint, as it would the
                // request.
                Err(_) if self.down_until.is_some() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(accepted)
    }
}

/// The `stats` JSON of every server of a fleet, in order.
pub async fn fleet_stats(clients: &[Client]) -> Result<Vec<String>> {
    let mut out = Vec::with_capacity(clients.len());
    for (i, c) in clients.iter().enumerate() {
        out.push(
            c.stats()
                .await
                .with_context(|| format!("server {i}'s stats"))?,
        );
    }
    Ok(out)
}

/// A fleet's per-tier counters: each tier's counters and capacities summed over the servers
/// (the per-slot sizes are the largest of them).
pub fn sum_stats(jsons: &[String]) -> Result<Vec<TierCounters>> {
    let mut total: Vec<TierCounters> = Vec::new();
    for j in jsons {
        for t in parse_stats(j)? {
            match total.iter_mut().find(|x| x.tier == t.tier) {
                Some(x) => x.add(&t),
                None => total.push(t),
            }
        }
    }
    Ok(total)
}

/// A miss that means the server is gone or refuses us: the replay stops.
fn fatal(m: &Miss) -> Option<String> {
    match m {
        Miss::Unavailable(why) => Some(format!("server unavailable: {why}")),
        Miss::Refused(why) => Some(format!("server refused: {why}")),
        Miss::Disconnected => Some("server disconnected".into()),
        Miss::Timeout => Some("server call timed out".into()),
        Miss::NotCached | Miss::Corrupt | Miss::IoError | Miss::Busy => None,
    }
}

impl Backend for ClientBackend {
    async fn serve(&self, keys: Vec<BlockKey>, blocks_to_store: usize) -> Result<Served> {
        let mut out = Served::default();
        let t = Instant::now();
        let look = self.client.lookup(&keys).await;
        if let Some(why) = look.miss.as_ref().and_then(fatal) {
            bail!("lookup: {why}");
        }
        out.busy += usize::from(look.miss == Some(Miss::Busy));
        out.lookup_blocks = look.tiers.len().min(keys.len());
        let n = out.lookup_blocks;
        if self.lookup_only {
            out.hit_blocks = n;
            // Where a get would read them: a remote block is in the server's DRAM now.
            out.tiers = look.tiers.iter().take(n).map(|t| t.held() as u8).collect();
        } else if n > 0 {
            let mut buf = vec![0u8; n * self.block_bytes];
            let mut bufs: Vec<&mut [u8]> = buf.chunks_mut(self.block_bytes).collect();
            let f = self.client.get_into(&keys[..n], &mut bufs).await;
            if let Some(why) = f.miss.as_ref().and_then(fatal) {
                bail!("get: {why}");
            }
            out.busy += usize::from(f.miss == Some(Miss::Busy));
            let got = f.blocks.min(n);
            // The usable prefix ends at the first block that fails verification.
            let mut good = got;
            for (i, b) in buf.chunks(self.block_bytes).take(got).enumerate() {
                if payload::verify(keys[i], b).is_err() {
                    out.corrupt_blocks += 1;
                    good = good.min(i);
                }
            }
            out.hit_blocks = good;
            out.tiers = f.tiers.iter().take(good).map(|t| *t as u8).collect();
        }
        out.load_s = t.elapsed().as_secs_f64();
        let from = out.hit_blocks;
        let to = blocks_to_store.min(keys.len());
        if from < to {
            let t = Instant::now();
            let mut buf = vec![0u8; (to - from) * self.block_bytes];
            for (k, b) in keys[from..to].iter().zip(buf.chunks_mut(self.block_bytes)) {
                payload::fill(*k, b);
            }
            let bufs: Vec<&[u8]> = buf.chunks(self.block_bytes).collect();
            let parent = from.checked_sub(1).map(|p| keys[p]);
            let stored = self.client.put_chain(&keys[from..to], parent, &bufs).await;
            if let Some(why) = stored.failure.as_ref().and_then(fatal) {
                bail!("put: {why}");
            }
            out.busy += usize::from(stored.failure == Some(Miss::Busy));
            out.put_blocks = to - from;
            out.stored_blocks = stored
                .statuses
                .iter()
                .filter(|s| matches!(s, PutStatus::Stored | PutStatus::AlreadyPresent))
                .count();
            out.store_s = t.elapsed().as_secs_f64();
        }
        Ok(out)
    }

    async fn retain(
        &self,
        session: u64,
        keys: Vec<BlockKey>,
        expected_return: Duration,
    ) -> Result<bool> {
        // Longer than the protocol allows: clipped (the server refuses it as too far anyway).
        let ret = expected_return.min(Duration::from_millis(kvtier_client::MAX_RETAIN_RETURN_MS));
        match self.client.retain(session, &keys, ret, 0).await {
            Ok(r) => Ok(r.accepted()),
            Err(e) => bail!("retain: {e}"),
        }
    }
}

/// Connects to `url`; an unreachable server is an error within [`CONNECT_TIMEOUT`].
pub async fn connect(
    url: &str,
    token: Option<&str>,
    quic_cert: Option<&Path>,
    zero_copy: bool,
) -> Result<Client> {
    let mut cfg = ClientConfig::default()
        .timeout(Duration::from_secs(30))
        .zero_copy(zero_copy);
    cfg.connect_timeout = CONNECT_TIMEOUT;
    if let Some(t) = token {
        cfg = cfg.token(t);
    }
    if let Some(p) = quic_cert {
        let der = std::fs::read(p)
            .with_context(|| format!("reading the QUIC certificate {}", p.display()))?;
        cfg = cfg.quic_cert_der(der);
    }
    match tokio::time::timeout(
        CONNECT_TIMEOUT + Duration::from_secs(1),
        Client::connect(url, cfg),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => bail!("cannot reach the kvtier server at {url}: {e}"),
        Err(_) => bail!(
            "cannot reach the kvtier server at {url}: no answer within {} s",
            CONNECT_TIMEOUT.as_secs()
        ),
    }
}

/// Tier sizes of an embedded server, in blocks.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    pub layout: KvLayout,
    pub dram_blocks: u64,
    pub nvme_blocks: u64,
    /// Parent of the NVMe tier's temporary directory.
    pub nvme_base: PathBuf,
    pub demotion: String,
    /// Extra `section.key=value` settings, applied last.
    pub sets: Vec<String>,
}

/// A server started in this process; its files live in temporary directories.
pub struct Embedded {
    pub server: Server,
    pub url: String,
    pub nvme_fs: Option<String>,
    _run: tempfile::TempDir,
    _nvme: Option<tempfile::TempDir>,
}

impl Embedded {
    pub async fn start(c: &EmbeddedConfig) -> Result<Embedded> {
        let run = tempfile::Builder::new()
            .prefix("kvtier-replay-")
            .tempdir()
            .context("creating the embedded server's runtime directory")?;
        let block = c.layout.block_bytes();
        let page = util::ALIGN as u64;
        let slot = block.next_multiple_of(page);
        let mut sets = vec![
            format!("server.runtime_dir={:?}", run.path().display().to_string()),
            "server.tcp=\"off\"".into(),
            "server.quic=\"off\"".into(),
            "server.tls=\"off\"".into(),
            "server.admin=\"off\"".into(),
            format!("store.dram_bytes={}", c.dram_blocks * slot),
            "store.dram_prefault=false".into(),
            format!("store.demotion={:?}", c.demotion),
            format!("layout.layers={}", c.layout.num_layers()),
            format!("layout.kv_heads={}", c.layout.num_kv_heads()),
            format!("layout.head_dim={}", c.layout.head_dim()),
            format!("layout.dtype={:?}", c.layout.dtype().name()),
            format!("layout.block_tokens={}", c.layout.block_tokens()),
        ];
        let (nvme, nvme_fs) = if c.nvme_blocks > 0 {
            std::fs::create_dir_all(&c.nvme_base).with_context(|| {
                format!("--nvme-dir {} cannot be created", c.nvme_base.display())
            })?;
            let dir = tempfile::Builder::new()
                .prefix("kvtier-replay-nvme-")
                .tempdir_in(&c.nvme_base)
                .with_context(|| format!("--nvme-dir {} is not writable", c.nvme_base.display()))?;
            let fs = util::fs_type(dir.path())?;
            if util::is_memory_fs(&fs) {
                eprintln!(
                    "warning: {} is on {fs}: the NVMe tier lives in memory, not on a disk",
                    dir.path().display()
                );
            }
            let need = c.nvme_blocks * (page + slot);
            let free = util::free_bytes(dir.path())?;
            if need > free {
                bail!(
                    "--nvme-tokens needs {} on {} but only {} are free",
                    util::Bytes(need),
                    dir.path().display(),
                    util::Bytes(free)
                );
            }
            sets.push(format!(
                "store.nvme_dir={:?}",
                dir.path().display().to_string()
            ));
            sets.push(format!("store.nvme_bytes={need}"));
            (Some(dir), Some(fs))
        } else {
            sets.push("store.nvme_dir=\"\"".into());
            (None, None)
        };
        let mut l = ConfigLoader::new();
        for s in sets.iter().chain(&c.sets) {
            l = l
                .set(s)
                .with_context(|| format!("embedded server setting {s}"))?;
        }
        let config = l.build()?;
        let server = Server::start(config)
            .await
            .context("starting the embedded server")?;
        let sock = server
            .endpoints()
            .unix
            .clone()
            .context("the embedded server has no Unix socket (server.unix=off?)")?;
        Ok(Embedded {
            server,
            url: format!("unix://{}", sock.display()),
            nvme_fs,
            _run: run,
            _nvme: nvme,
        })
    }

    pub async fn stop(self) {
        let Embedded {
            server,
            _run,
            _nvme,
            ..
        } = self;
        server.shutdown().await;
        drop((_run, _nvme));
    }
}

/// One tier's counters from the server's statistics.
pub type TierCounters = kvtier_server::TierStats;

/// Held lookups and lookups refused a hold, from a server's `stats` JSON (0 from a server
/// that does not report them).
pub fn parse_holds(json: &str) -> (u64, u64) {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let n = |k: &str| v["store"][k].as_u64().unwrap_or(0);
    (n("lookup_holds"), n("lookup_holds_refused"))
}

/// The retention-hint counters in a server's `stats` JSON (zeros from a server without).
/// Over a fleet, each counter is the sum of the servers' (budgets too).
pub fn parse_retain(jsons: &[String]) -> kvtier_server::RetainStats {
    let mut sum = serde_json::Map::new();
    for json in jsons {
        let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
        if let Some(o) = v["store"]["retain"].as_object() {
            for (k, x) in o {
                let add = x.as_u64().unwrap_or(0);
                let e = sum.entry(k.clone()).or_insert(serde_json::json!(0u64));
                *e = serde_json::json!(e.as_u64().unwrap_or(0).saturating_add(add));
            }
        }
    }
    serde_json::from_value(serde_json::Value::Object(sum)).unwrap_or_default()
}

/// The per-tier counters in a server's `stats` JSON.
pub fn parse_stats(json: &str) -> Result<Vec<TierCounters>> {
    let v: serde_json::Value =
        serde_json::from_str(json).context("the server's stats are not JSON")?;
    let tiers = v["store"]["tiers"].clone();
    if !tiers.is_array() {
        anyhow::bail!("the server's stats have no store.tiers list");
    }
    serde_json::from_value(tiers).context("the server's store.tiers are malformed")
}
