//! Prefix reuse through the kvtier sidecar.
//!
//! Per request: hash the prompt's full blocks ([`PrefixHasher`] under a namespace of the model
//! id, the [`KvLayout`] fingerprint and the request's `cache_salt`), look up the longest cached
//! prefix, decide with the cost model how much of it to load, and fetch it:
//! over `unix://` the blocks are pinned in the sidecar's DRAM arena ([`Client::get_pinned`])
//! and the scheduler copies each one straight into its pool block (bytes cross memory once),
//! unless the prefix is longer than the arena ([`Client::arena_blocks`]): then, and
//! over `tcp://` / `quic://`, they are read with [`Client::get_into`] into one staging buffer
//! that the scheduler copies into the pool (the pool is owned by the compute thread, so a
//! network read cannot target it from the request task).
//!
//! After prefill the scheduler hands the new full blocks to [`Sidecar::queue_store`]: a
//! bounded queue ([`STORE_QUEUE_DEPTH`]) drained by one task that calls
//! [`Client::put_chain`]; when the queue is full the store is dropped and counted.
//!
//! Any cache failure (no sidecar, timeout, lost connection, corrupt block, busy) is a miss: the
//! request recomputes and the reason is counted in `kvtier_worker_cache_fallbacks_total`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_client::{
    Client, ClientConfig, ClientError, ErrorCode, Miss, PinnedBlocks, PutStatus, Stored, TierCode,
};
use kvtier_core::{BlockKey, HashSecret, KvLayout};
use tokio::sync::mpsc;

use crate::error::{Result, WorkerError};
use crate::metrics::{Metrics, add};
use crate::prefix_cache::BlockKeys;

/// Deadline of every sidecar call; past it the request recomputes. Default 1 s.
pub const SIDECAR_TIMEOUT: Duration = Duration::from_secs(1);
/// Stores waiting for the sidecar (one per request); more are dropped and counted.
pub const STORE_QUEUE_DEPTH: usize = 64;
/// Lease of a pinned prefix: the scheduler must copy it into the pool before this runs out
/// (a request that waits longer for pool blocks recomputes instead).
pub const PIN_LEASE: Duration = Duration::from_secs(10);
/// Without a connection, a new connect is tried at most this often.
pub const RECONNECT_INTERVAL: Duration = Duration::from_millis(500);
/// Weight of the newest sample in the bandwidth and prefill-rate averages.
pub const EWMA_ALPHA: f64 = 0.3;
/// At most one warning per this interval about stores the sidecar refused (the others are
/// counted, and summed into the next warning).
pub const REFUSED_STORE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// How to reach the sidecar and make keys.
#[derive(Clone, Debug)]
pub struct SidecarSettings {
    /// `unix:///path`, `tcp://host:port`, `tls://host:port` or `quic://host:port`.
    pub url: String,
    /// Token for tcp/quic.
    pub token: Option<String>,
    /// The server's certificate (DER) to trust over `tls://` and `quic://`.
    pub quic_cert_der: Option<Vec<u8>>,
    /// The deployment's hash secret (every worker sharing blocks uses the same one).
    pub secret: HashSecret,
    /// Model id in the namespace.
    pub model_id: String,
}

/// How the prompt's cached prefix gets into the KV pool. The scheduler asks only for
/// `blocks()` and `block(i)`; a remote prefill (disaggregated serving) is one more variant.
pub enum PrefixSource {
    /// Nothing to load: the whole prompt is computed.
    None,
    /// Blocks pinned in the local sidecar's DRAM arena, read in place (zero-copy path).
    Pinned(PinnedBlocks),
    /// Blocks read into memory (remote sidecar): `blocks` blocks back to back, and the tier
    /// the server's lookup said held each.
    Staged {
        bytes: Vec<u8>,
        blocks: usize,
        block_bytes: usize,
        tiers: Vec<TierCode>,
    },
}

impl PrefixSource {
    pub fn blocks(&self) -> usize {
        match self {
            PrefixSource::None => 0,
            PrefixSource::Pinned(p) => p.len(),
            PrefixSource::Staged { blocks, .. } => *blocks,
        }
    }

    /// Block `i` (`i < blocks()`).
    pub fn block(&self, i: usize) -> &[u8] {
        match self {
            PrefixSource::None => &[],
            PrefixSource::Pinned(p) => p.block(i),
            PrefixSource::Staged {
                bytes, block_bytes, ..
            } => &bytes[i * block_bytes..(i + 1) * block_bytes],
        }
    }

    /// The tier that held block `i` (`i < blocks()`), as the server reported it.
    pub fn tier(&self, i: usize) -> Option<TierCode> {
        match self {
            PrefixSource::None => None,
            PrefixSource::Pinned(p) => p.tiers().get(i).copied(),
            PrefixSource::Staged { tiers, .. } => tiers.get(i).copied(),
        }
    }

    /// Whether the bytes may still be read (a pin's lease has not run out).
    pub fn usable(&self) -> bool {
        match self {
            // Keep a margin: the copy itself takes time.
            PrefixSource::Pinned(p) => Instant::now() + Duration::from_millis(200) < p.deadline(),
            _ => true,
        }
    }
}

/// What the sidecar knows about one prompt, for the scheduler.
pub struct Prefix {
    /// Keys of every full block of the prompt.
    pub keys: Vec<BlockKey>,
    /// Where the loaded blocks come from: `source.blocks()` blocks from key `source_first` on.
    pub source: PrefixSource,
    /// Index in `keys` of the source's first block (the blocks before it were not asked
    /// for: the local prefix cache holds them).
    pub source_first: usize,
    /// Blocks from this index on are stored after prefill (earlier ones are cached).
    pub store_from: usize,
    /// Time spent in sidecar calls for this prompt (lookup + pin/get).
    pub fetch_time: Duration,
    /// Whether the blocks may be stored (false without a sidecar).
    pub store: bool,
    /// The request's `cache_salt` (part of the keys), for keying generated blocks later.
    pub cache_salt: Option<Vec<u8>>,
    /// The request's `kvtier_retain_s`: after the response, the sidecar is asked to keep the
    /// prefix until the client's next request.
    pub retain: Option<Duration>,
    /// Which of the source's blocks (by index in it) the server's cluster fetched from
    /// another member for the lookup (its tier `remote`; a pin or get reports them as DRAM,
    /// where they are by then).
    pub remote: Vec<std::ops::Range<usize>>,
}

impl Prefix {
    /// The tier block `i` of `source` (this prefix's source, moved out) came from: remote
    /// where the lookup fetched it from another member, else where the server read it.
    pub fn tier(&self, source: &PrefixSource, i: usize) -> Option<TierCode> {
        if self.remote.iter().any(|r| r.contains(&i)) {
            return Some(TierCode::Remote);
        }
        source.tier(i)
    }

    /// No sidecar: compute everything, store nothing.
    pub fn none() -> Self {
        Self {
            keys: Vec::new(),
            source: PrefixSource::None,
            source_first: 0,
            store_from: 0,
            fetch_time: Duration::ZERO,
            store: false,
            cache_salt: None,
            retain: None,
            remote: Vec::new(),
        }
    }

    /// No sidecar, but the local prefix cache: the prompt's keys, nothing loaded or stored.
    pub fn local(keys: Vec<BlockKey>, cache_salt: Option<&[u8]>) -> Self {
        Self {
            keys,
            cache_salt: cache_salt.map(<[u8]>::to_vec),
            ..Self::none()
        }
    }
}

/// New full blocks to store: `keys[i]` has bytes `bytes[i*B..(i+1)*B]`, the first's parent is
/// `parent`.
pub struct StoreJob {
    pub keys: Vec<BlockKey>,
    pub parent: Option<BlockKey>,
    pub bytes: Vec<u8>,
    /// After the store: a retention hint for these keys (a chain from its first block),
    /// expected back in this long.
    pub retain: Option<(Vec<BlockKey>, Duration)>,
}

/// Running averages for the cost model.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rates {
    /// Prefill speed, tokens/s.
    pub prefill_tokens_per_s: Option<f64>,
    /// Load bandwidth of prefixes entirely in DRAM, bytes/s (sidecar call + copy into pool).
    pub dram_bytes_per_s: Option<f64>,
    /// Load bandwidth of prefixes with NVMe blocks, bytes/s.
    pub nvme_bytes_per_s: Option<f64>,
}

fn ewma(old: &mut Option<f64>, sample: f64) {
    if !sample.is_finite() || sample <= 0.0 {
        return;
    }
    *old = Some(match *old {
        None => sample,
        Some(o) => o + EWMA_ALPHA * (sample - o),
    });
}

impl Rates {
    /// How many leading blocks of a cached prefix (tier of each in `tiers`) to load: the
    /// candidate (all of it, or its leading DRAM run) that saves the most estimated time
    /// over recomputing it; 0 when loading would not be faster. An unmeasured rate is
    /// optimistic for loading (the first loads measure it).
    pub fn blocks_to_load(
        &self,
        tiers: &[TierCode],
        block_bytes: usize,
        block_tokens: usize,
    ) -> usize {
        // A remote block was fetched into the sidecar's DRAM by its lookup.
        let dram_run = tiers
            .iter()
            .take_while(|t| t.held() == TierCode::Dram)
            .count();
        let Some(rate) = self.prefill_tokens_per_s else {
            return tiers.len();
        };
        let saving = |k: usize| {
            let compute = (k * block_tokens) as f64 / rate;
            let bytes = (k * block_bytes) as f64;
            let bw = if k > dram_run {
                self.nvme_bytes_per_s
            } else {
                self.dram_bytes_per_s
            };
            let load = bw.map_or(0.0, |bw| bytes / bw);
            compute - load
        };
        let mut best = (0, 0.0);
        for k in [dram_run, tiers.len()] {
            let s = saving(k);
            if k > 0 && s > best.1 {
                best = (k, s);
            }
        }
        best.0
    }
}

/// The worker's link to the kvtier sidecar.
pub struct Sidecar {
    settings: SidecarSettings,
    client_config: ClientConfig,
    layout: KvLayout,
    keys: BlockKeys,
    block_bytes: usize,
    client: Mutex<Option<Client>>,
    next_connect: Mutex<Instant>,
    rates: Mutex<Rates>,
    store_tx: Mutex<Option<mpsc::Sender<StoreJob>>>,
    store_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    metrics: Arc<Metrics>,
}

fn miss_reason(m: &Miss) -> &'static str {
    match m {
        Miss::NotCached => "not_cached",
        Miss::Corrupt => "corrupt",
        Miss::IoError => "io_error",
        Miss::Busy => "busy",
        Miss::Timeout => "timeout",
        Miss::Disconnected => "disconnected",
        Miss::Unavailable(_) => "unavailable",
        Miss::Refused(_) => "refused",
    }
}

fn error_reason(e: &ClientError) -> &'static str {
    match e {
        ClientError::Timeout => "timeout",
        ClientError::Disconnected | ClientError::Io(_) => "disconnected",
        ClientError::Connect(_) => "unavailable",
        ClientError::Server {
            code: Some(ErrorCode::Busy),
            ..
        } => "busy",
        _ => "refused",
    }
}

impl Sidecar {
    /// Connects to the sidecar. A server whose block size differs from the model's, or a bad
    /// address, is an error; a server that cannot be reached is not (the worker serves without
    /// it and keeps trying). Must run inside a tokio runtime (the store task is spawned).
    pub async fn connect(
        settings: SidecarSettings,
        layout: KvLayout,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Sidecar>> {
        let block_bytes = layout.block_bytes() as usize;
        let mut cfg = ClientConfig::default()
            .timeout(SIDECAR_TIMEOUT)
            .block_bytes(block_bytes as u64)
            .reconnect_backoff(RECONNECT_INTERVAL);
        cfg.connect_timeout = SIDECAR_TIMEOUT;
        cfg.lease = PIN_LEASE;
        cfg.name = format!("kvtier-worker {}", settings.model_id);
        if let Some(t) = &settings.token {
            cfg = cfg.token(t.clone());
        }
        if let Some(c) = &settings.quic_cert_der {
            cfg = cfg.quic_cert_der(c.clone());
        }
        let (tx, rx) = mpsc::channel(STORE_QUEUE_DEPTH);
        let sidecar = Arc::new(Sidecar {
            settings: settings.clone(),
            client_config: cfg,
            keys: BlockKeys::new(settings.secret.clone(), settings.model_id.clone(), layout),
            layout,
            block_bytes,
            client: Mutex::new(None),
            next_connect: Mutex::new(Instant::now()),
            rates: Mutex::new(Rates::default()),
            store_tx: Mutex::new(Some(tx)),
            store_task: Mutex::new(None),
            metrics,
        });
        match Client::connect(&sidecar.settings.url, sidecar.client_config.clone()).await {
            Ok(c) => {
                tracing::info!(
                    url = %sidecar.settings.url,
                    zero_copy = c.is_local(),
                    block_bytes,
                    "connected to the kvtier sidecar"
                );
                *sidecar.client.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
            }
            Err(e) => sidecar.check_connect_error(&e)?,
        }
        let task = tokio::spawn(store_loop(sidecar.clone(), rx));
        *sidecar.store_task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        Ok(sidecar)
    }

    /// Fatal connect errors become [`WorkerError::Sidecar`]; others are logged.
    fn check_connect_error(&self, e: &ClientError) -> Result<()> {
        let url = self.settings.url.clone();
        match e {
            ClientError::BadUrl(_) => Err(WorkerError::Sidecar {
                url,
                reason: e.to_string(),
            }),
            ClientError::Server {
                code: Some(ErrorCode::LayoutMismatch),
                message,
            } => {
                let l = &self.layout;
                Err(WorkerError::Sidecar {
                    url,
                    reason: format!(
                        "the server refused this worker's {}-byte blocks ({message}). Start \
                         kvtier-server with this model's layout: --set layout.layers={} --set \
                         layout.kv_heads={} --set layout.head_dim={} --set layout.dtype='\"{}\"' \
                         --set layout.block_tokens={}",
                        self.block_bytes,
                        l.num_layers(),
                        l.num_kv_heads(),
                        l.head_dim(),
                        l.dtype().name(),
                        l.block_tokens()
                    ),
                })
            }
            ClientError::Server {
                code: Some(ErrorCode::Unauthorized),
                ..
            } => Err(WorkerError::Sidecar {
                url,
                reason: format!("{e} (check --sidecar-token)"),
            }),
            _ => {
                tracing::warn!(%url, error = %e, "kvtier sidecar unreachable; serving without it, will retry");
                Ok(())
            }
        }
    }

    /// The connected client, connecting (at most every [`RECONNECT_INTERVAL`]) when there is
    /// none. Once connected, the SDK reopens lost connections itself.
    async fn client(&self) -> Option<Client> {
        if let Some(c) = self
            .client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Some(c);
        }
        {
            let mut next = self.next_connect.lock().unwrap_or_else(|p| p.into_inner());
            if Instant::now() < *next {
                return None;
            }
            *next = Instant::now() + RECONNECT_INTERVAL;
        }
        match Client::connect(&self.settings.url, self.client_config.clone()).await {
            Ok(c) => {
                tracing::info!(url = %self.settings.url, "connected to the kvtier sidecar");
                *self.client.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
                Some(c)
            }
            Err(e) => {
                tracing::debug!(error = %e, "kvtier sidecar still unreachable");
                None
            }
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Whether a client is connected now (the connection itself may still fail).
    pub fn is_connected(&self) -> bool {
        self.client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    pub fn rates(&self) -> Rates {
        *self.rates.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Feeds the prefill rate: `tokens` computed in `took`.
    pub fn observe_prefill(&self, tokens: usize, took: Duration) {
        if tokens >= 16 {
            let mut r = self.rates.lock().unwrap_or_else(|p| p.into_inner());
            ewma(
                &mut r.prefill_tokens_per_s,
                tokens as f64 / took.as_secs_f64().max(1e-9),
            );
        }
    }

    /// Feeds the load bandwidth: `bytes` brought into the pool in `took`.
    pub fn observe_load(&self, bytes: usize, took: Duration, any_nvme: bool) {
        let mut r = self.rates.lock().unwrap_or_else(|p| p.into_inner());
        let bw = bytes as f64 / took.as_secs_f64().max(1e-9);
        if any_nvme {
            ewma(&mut r.nvme_bytes_per_s, bw);
        } else {
            ewma(&mut r.dram_bytes_per_s, bw);
        }
    }

    /// The keys of `tokens`' full blocks under the request's `cache_salt`.
    pub fn keys(&self, tokens: &[u32], cache_salt: Option<&[u8]>) -> Result<Vec<BlockKey>> {
        self.keys.keys(tokens, cache_salt)
    }

    /// The key maker (the local prefix cache keys blocks the same way).
    pub fn block_keys(&self) -> &BlockKeys {
        &self.keys
    }

    /// Looks up and fetches the longest worthwhile cached prefix of `tokens`. Never fails:
    /// anything wrong is a (counted) miss.
    pub async fn prepare(&self, tokens: &[u32], cache_salt: Option<&[u8]>) -> Prefix {
        self.prepare_after(tokens, cache_salt, |_| 0).await
    }

    /// [`prepare`](Self::prepare), fetching only the blocks past the `held(keys)` leading
    /// blocks the worker holds already (its local prefix cache).
    pub async fn prepare_after(
        &self,
        tokens: &[u32],
        cache_salt: Option<&[u8]>,
        held: impl FnOnce(&[BlockKey]) -> usize,
    ) -> Prefix {
        let t0 = Instant::now();
        let keys = match self.keys(tokens, cache_salt) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hash the prompt; not using the cache");
                self.metrics.cache_fallbacks.inc("hash_error");
                return Prefix::none();
            }
        };
        let skip = held(&keys).min(keys.len());
        let mut prefix = Prefix {
            keys,
            source: PrefixSource::None,
            source_first: skip,
            store_from: 0,
            fetch_time: Duration::ZERO,
            store: true,
            cache_salt: cache_salt.map(<[u8]>::to_vec),
            retain: None,
            remote: Vec::new(),
        };
        if prefix.keys.is_empty() {
            return prefix;
        }
        let Some(client) = self.client().await else {
            self.metrics.cache_fallbacks.inc("unavailable");
            return prefix;
        };
        let lookup = client.lookup(&prefix.keys).await;
        let cached = lookup.tiers.len();
        // Positions from `skip` on: the source's blocks.
        prefix.remote = lookup
            .sources
            .iter()
            .map(|s| s.blocks.start.max(skip) - skip..s.blocks.end.max(skip) - skip)
            .filter(|r| !r.is_empty())
            .collect();
        if let Some(m) = &lookup.miss
            && *m != Miss::NotCached
        {
            self.metrics.cache_fallbacks.inc(miss_reason(m));
        }
        prefix.store_from = cached;
        if cached <= skip {
            prefix.fetch_time = t0.elapsed();
            return prefix;
        }
        let bt = self.layout.block_tokens() as usize;
        let load = self
            .rates()
            .blocks_to_load(&lookup.tiers[skip..], self.block_bytes, bt);
        let want = skip + load;
        if want < cached {
            add(&self.metrics.loads_skipped_cost, 1);
        }
        if load == 0 {
            prefix.fetch_time = t0.elapsed();
            return prefix;
        }
        let keys = &prefix.keys[skip..want];
        // A prefix longer than the sidecar's DRAM cannot be pinned at once: it is copied out
        // with get_into, which streams it through DRAM in rounds.
        if client.is_local() && keys.len() <= client.arena_blocks().await {
            match client.get_pinned(keys, PIN_LEASE).await {
                Ok(p) => {
                    if let Some(m) = p.miss()
                        && *m != Miss::NotCached
                    {
                        self.metrics.cache_fallbacks.inc(miss_reason(m));
                    }
                    // Stopped before `want` (evicted, corrupt, busy): the chain is stored
                    // again from there. Blocks skipped by the cost model are still cached.
                    if skip + p.len() < want {
                        prefix.store_from = skip + p.len();
                    }
                    prefix.source = PrefixSource::Pinned(p);
                }
                Err(e) => {
                    self.metrics.cache_fallbacks.inc(error_reason(&e));
                    prefix.store_from = 0;
                }
            }
        } else {
            let mut bytes = vec![0u8; load * self.block_bytes];
            let got = {
                let mut bufs: Vec<&mut [u8]> = bytes.chunks_exact_mut(self.block_bytes).collect();
                client.get_into(keys, &mut bufs).await
            };
            if let Some(m) = &got.miss
                && *m != Miss::NotCached
            {
                self.metrics.cache_fallbacks.inc(miss_reason(m));
            }
            if skip + got.blocks < want {
                prefix.store_from = skip + got.blocks;
            }
            bytes.truncate(got.blocks * self.block_bytes);
            if got.blocks > 0 {
                prefix.source = PrefixSource::Staged {
                    bytes,
                    blocks: got.blocks,
                    block_bytes: self.block_bytes,
                    tiers: lookup.tiers[skip..(skip + got.blocks).min(cached)].to_vec(),
                };
            }
        }
        prefix.fetch_time = t0.elapsed();
        prefix
    }

    /// Queues a store without waiting; returns false (and counts it) when the queue is full
    /// or closed. `make` is called only when there is room, to copy the blocks out.
    pub fn queue_store(&self, make: impl FnOnce() -> Option<StoreJob>) -> bool {
        let tx = self
            .store_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(tx) = tx else {
            add(&self.metrics.stores_dropped, 1);
            return false;
        };
        let Ok(permit) = tx.try_reserve() else {
            add(&self.metrics.stores_dropped, 1);
            return false;
        };
        match make() {
            Some(job) => {
                permit.send(job);
                add(&self.metrics.stores_queued, 1);
                true
            }
            None => false,
        }
    }

    /// Stops taking stores and waits (up to `timeout`) for the queued ones to reach the
    /// sidecar; what is left after it is dropped.
    pub async fn close(&self, timeout: Duration) {
        self.store_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let task = self
            .store_task
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(mut task) = task
            && tokio::time::timeout(timeout, &mut task).await.is_err()
        {
            tracing::warn!("stores still queued at shutdown; dropping them");
            task.abort();
        }
    }
}

/// Why the sidecar did not take (all of) a store, when it refused it: `None` when every
/// block was stored or already there, or the store failed otherwise (no connection, a
/// timeout, a server I/O error: counted as store failures).
pub fn refusal(stored: &Stored) -> Option<&'static str> {
    match &stored.failure {
        Some(Miss::Busy) => return Some("busy"),
        Some(Miss::Refused(_)) => return Some("refused"),
        Some(_) => return None,
        None => {}
    }
    stored.statuses.iter().find_map(|s| match s {
        PutStatus::RejectedBacklog => Some("backlog"),
        PutStatus::RejectedNoSlot => Some("no_slot"),
        PutStatus::RejectedOrphan => Some("orphan"),
        _ => None,
    })
}

/// Warns about refused stores at most once per [`REFUSED_STORE_LOG_INTERVAL`], with the
/// number of refusals since the last warning.
struct RefusalLog {
    last: Option<Instant>,
    unlogged: u64,
}

impl RefusalLog {
    fn refused(&mut self, why: &'static str, blocks: usize, refused_blocks: usize) {
        self.unlogged += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < REFUSED_STORE_LOG_INTERVAL)
        {
            return;
        }
        tracing::warn!(
            reason = why,
            blocks,
            refused_blocks,
            refused_stores_since_last_warning = self.unlogged,
            "the kvtier sidecar refused a store: those blocks are not cached (counted in \
             kvtier_worker_stores_refused_total)"
        );
        self.last = Some(now);
        self.unlogged = 0;
    }
}

async fn store_loop(sidecar: Arc<Sidecar>, mut rx: mpsc::Receiver<StoreJob>) {
    let mut log = RefusalLog {
        last: None,
        unlogged: 0,
    };
    while let Some(job) = rx.recv().await {
        let Some(client) = sidecar.client().await else {
            add(&sidecar.metrics.store_failures, 1);
            continue;
        };
        if !job.keys.is_empty() {
            let bufs: Vec<&[u8]> = job.bytes.chunks_exact(sidecar.block_bytes).collect();
            let stored = client.put_chain(&job.keys, job.parent, &bufs).await;
            add(&sidecar.metrics.blocks_stored, stored.cached() as u64);
            if let Some(why) = refusal(&stored) {
                add(&sidecar.metrics.stores_refused, 1);
                log.refused(why, job.keys.len(), job.keys.len() - stored.cached());
            } else if let Some(why) = stored.failure {
                tracing::debug!(?why, "store failed");
                add(&sidecar.metrics.store_failures, 1);
            }
        }
        if let Some((keys, after)) = &job.retain {
            // After the blocks above: the hint protects what they stored.
            match client.retain(0, keys, *after, 0).await {
                Ok(r) if r.accepted() => add(&sidecar.metrics.retain_hints_accepted, 1),
                Ok(r) => {
                    tracing::debug!(status = ?r.status, "retention hint not taken");
                    add(&sidecar.metrics.retain_hints_refused, 1);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "retention hint failed");
                    add(&sidecar.metrics.retain_hints_refused, 1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_model_loads_only_when_faster() {
        let bt = 16;
        let block = 32 << 10;
        let dram = TierCode::Dram;
        let nvme = TierCode::Nvme;
        // Unmeasured: load everything.
        let r = Rates::default();
        assert_eq!(r.blocks_to_load(&[dram, nvme], block, bt), 2);
        // Prefill 1,000 tokens/s = 16 ms a block; DRAM 1 GB/s = 33 us a block: load.
        let mut r = Rates {
            prefill_tokens_per_s: Some(1000.0),
            dram_bytes_per_s: Some(1e9),
            nvme_bytes_per_s: Some(1e9),
        };
        assert_eq!(r.blocks_to_load(&[dram, dram, nvme], block, bt), 3);
        // NVMe slower than recomputing (1 MB/s = 33 ms a block): only the DRAM run.
        r.nvme_bytes_per_s = Some(1e6);
        assert_eq!(r.blocks_to_load(&[dram, dram, nvme], block, bt), 2);
        // A block the sidecar's cluster fetched for the lookup is in its DRAM now.
        let remote = TierCode::Remote;
        assert_eq!(r.blocks_to_load(&[dram, remote, nvme], block, bt), 2);
        assert_eq!(r.blocks_to_load(&[nvme, dram], block, bt), 0);
        // Everything slower than recomputing: nothing.
        r.dram_bytes_per_s = Some(1e6);
        assert_eq!(r.blocks_to_load(&[dram], block, bt), 0);
        assert_eq!(r.blocks_to_load(&[], block, bt), 0);
    }

    #[test]
    fn refusals_are_told_from_other_failures() {
        let check = |statuses: Vec<PutStatus>, failure: Option<Miss>, want: Option<&str>| {
            let s = kvtier_client::Stored { statuses, failure };
            assert_eq!(refusal(&s), want, "{s:?}");
        };
        use PutStatus::{
            AlreadyPresent, Failed, RejectedBacklog, RejectedNoSlot, RejectedOrphan, Stored,
        };
        check(vec![Stored, AlreadyPresent], None, None);
        check(vec![Stored, RejectedBacklog], None, Some("backlog"));
        check(vec![RejectedNoSlot], None, Some("no_slot"));
        check(vec![RejectedOrphan, RejectedOrphan], None, Some("orphan"));
        check(vec![Failed], None, None);
        check(vec![], Some(Miss::Busy), Some("busy"));
        check(vec![], Some(Miss::Refused("quota".into())), Some("refused"));
        check(vec![], Some(Miss::Timeout), None);
        check(vec![], Some(Miss::Disconnected), None);
    }

    #[test]
    fn ewma_ignores_nonsense_and_averages() {
        let mut x = None;
        ewma(&mut x, f64::NAN);
        ewma(&mut x, 0.0);
        assert_eq!(x, None);
        ewma(&mut x, 10.0);
        assert_eq!(x, Some(10.0));
        ewma(&mut x, 20.0);
        assert!((x.unwrap() - 13.0).abs() < 1e-9);
    }
}
