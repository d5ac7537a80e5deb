//! Continuous batching: one thread owns the [`Engine`] and runs every admitted sequence a
//! step at a time, round-robin. A step is one prefill chunk ([`PREFILL_CHUNK_TOKENS`]) or one
//! decode token, so a long prompt never holds up the others' decoding for longer than a chunk,
//! and requests join and leave between steps.
//!
//! The forward itself is per sequence (candle's `forward` takes one sequence; a batched
//! forward over sequences of different lengths needs a paged-attention kernel, later work):
//! this is interleaving, not a fused batch, so throughput is that of one sequence at a time
//! and latency is shared fairly.
//!
//! Admission: a bounded queue ([`ADMISSION_QUEUE_DEPTH`], full = "busy" to the caller); the
//! head request is admitted when fewer than `max_batch` sequences run and the pool has the
//! blocks for its whole worst case (prompt + `max_tokens`), so a running sequence never runs
//! out of blocks. Pool exhaustion queues; a request larger than the whole pool is refused
//! before it is queued ([`Scheduler::blocks_needed`]).
//!
//! A request may arrive already prefilled ([`GenRequest::prefilled`], the decode role of
//! disaggregated serving): its prompt's KV is in pool blocks it holds, so admission reserves
//! only the blocks its decoding adds, and its first step samples from the prefill's logits.
//!
//! The engine sits behind a mutex shared with the disaggregation objects (which reserve
//! blocks and run forwards of their own); the loop takes it per step.
//!
//! With the local prefix cache on ([`crate::prefix_cache`], role both only: there the
//! scheduler is the pool's only user), a request's leading blocks already in the pool are
//! used in place, the prompt's full blocks are entered there once prefilled and the
//! generated ones when the sequence ends, and idle cached blocks are given up (least
//! recently used first) when an admission needs their pages.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::engine::{Engine, FinishReason, Sampler, Sampling};
use crate::error::{Result, WorkerError};
use crate::kv_cache::BlockTable;
use crate::metrics::{Metrics, add};
use crate::prefix_cache::{BlockKeys, PrefixCache};
use crate::sidecar::{Prefix, PrefixSource, Sidecar, StoreJob};

/// Tokens computed per prefill step.
pub const PREFILL_CHUNK_TOKENS: usize = 512;
/// Requests waiting for admission; more are refused as busy.
pub const ADMISSION_QUEUE_DEPTH: usize = 256;

/// One generation request.
pub struct GenRequest {
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// What the sidecar has for this prompt ([`Prefix::none`] without one).
    pub prefix: Prefix,
    pub events: mpsc::UnboundedSender<SeqEvent>,
    /// When the request arrived (TTFT and end-to-end latency count from here).
    pub arrived: Instant,
    /// The prompt's KV, already in the pool (disaggregated decode role); `None` to prefill
    /// here.
    pub prefilled: Option<PrefilledKv>,
    /// Whatever the caller reserved for the request (the decode role's block budget), released
    /// when the request ends (after `prefilled`, declared before it, has freed its blocks).
    pub budget: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// A prompt whose KV is already in pool blocks: `table` covers every prompt position and
/// `logits` are those of the last one. Dropped before the scheduler takes it (a full queue,
/// a cancelled request), it returns its blocks to the pool.
pub struct PrefilledKv {
    pub table: BlockTable,
    pub logits: Vec<f32>,
    pub engine: Arc<Mutex<Engine>>,
}

impl Drop for PrefilledKv {
    fn drop(&mut self) {
        if self.table.is_empty() {
            return;
        }
        if let Err(e) = lock(&self.engine)
            .cache_mut()
            .release_table(&mut self.table)
        {
            tracing::error!(error = %e, "releasing an unscheduled prefilled prompt's blocks");
        }
    }
}

/// Locks the engine, recovering it from a holder that panicked (the pool's bookkeeping only
/// changes in short sections that call no candle code).
pub(crate) fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    engine.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long the loop sleeps when the head request waits for blocks held outside the
/// scheduler (a remote prefill in flight, a quarantine) and nothing runs.
const BLOCKED_POLL: Duration = Duration::from_millis(2);

/// What a running request reports.
#[derive(Debug)]
pub enum SeqEvent {
    Token(u32),
    Done(Usage),
    Failed(String),
}

/// A finished request's accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was not recomputed: loaded from kvtier or found in the
    /// worker's own prefix cache.
    pub cached_tokens: usize,
    /// Where they came from and what loading them took (`usage.kvtier` in the answer).
    pub load: LoadReport,
}

/// Where a request's cached prompt blocks came from, and the time loading them took: what a
/// router needs to learn this worker's load bandwidth per tier (`docs/worker.md`,
/// `usage.kvtier`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Prompt tokens of the leading blocks found in the worker's own prefix cache (used in
    /// place: nothing loaded).
    pub local_tokens: usize,
    /// Prompt tokens of the blocks copied in from the sidecar, by the tier its server said
    /// held them (index: `TierCode` as `usize`: HBM, DRAM, NVMe, and remote: blocks the
    /// server's cluster fetched from another member for the lookup, whose time is in
    /// `load_time`).
    pub loaded_tokens: [usize; 4],
    /// Bytes of those blocks, by tier.
    pub loaded_bytes: [u64; 4],
    /// Time of the sidecar calls for the prompt (lookup, pin or get) and of the copy into
    /// the pool; zero when nothing was loaded.
    pub load_time: Duration,
}

/// Why a request could not be queued.
#[derive(Debug)]
pub enum SubmitError {
    /// The admission queue is full.
    Busy,
    /// The scheduler has stopped.
    Stopped,
}

/// Handle to the scheduler thread.
#[derive(Clone)]
pub struct Scheduler {
    tx: mpsc::Sender<GenRequest>,
    /// The local prefix cache's index, for [`local_hits`](Self::local_hits).
    local: Option<Arc<Mutex<PrefixCache>>>,
    pool_blocks: usize,
    block_tokens: usize,
    max_context_tokens: usize,
}

impl Scheduler {
    /// Starts the scheduler thread. It enters `runtime` (pinned prefixes release their pins
    /// through it) and stops when every handle is dropped and the last sequence ends.
    /// `prefix_cache`: keep a local prefix cache in the pool, keyed by these keys (the
    /// requests' [`Prefix::keys`] must be made by the same); only where the scheduler is the
    /// pool's only user.
    pub fn start(
        engine: Arc<Mutex<Engine>>,
        max_batch: usize,
        sidecar: Option<Arc<Sidecar>>,
        metrics: Arc<Metrics>,
        runtime: tokio::runtime::Handle,
        prefix_cache: Option<BlockKeys>,
    ) -> Result<(Scheduler, std::thread::JoinHandle<()>)> {
        if max_batch == 0 {
            return Err(WorkerError::Serve {
                setting: "max_batch".into(),
                reason: "must be at least 1".into(),
            });
        }
        let (tx, rx) = mpsc::channel(ADMISSION_QUEUE_DEPTH);
        let local = prefix_cache.map(|keys| LocalCache {
            index: Arc::new(Mutex::new(PrefixCache::new())),
            keys,
        });
        let handle = {
            let e = lock(&engine);
            Scheduler {
                tx,
                local: local.as_ref().map(|l| Arc::clone(&l.index)),
                pool_blocks: e.cache().num_blocks(),
                block_tokens: e.cache().block_tokens(),
                max_context_tokens: e.model().config().max_context_tokens,
            }
        };
        let join = std::thread::Builder::new()
            .name("kvtier-scheduler".into())
            .spawn(move || {
                let _rt = runtime.enter();
                Loop {
                    engine,
                    max_batch,
                    sidecar,
                    metrics,
                    rx,
                    running: Vec::new(),
                    waiting: VecDeque::new(),
                    local,
                }
                .run();
            })
            .map_err(|e| WorkerError::Serve {
                setting: "scheduler thread".into(),
                reason: e.to_string(),
            })?;
        Ok((handle, join))
    }

    /// Pool blocks a request needs for its worst case.
    pub fn blocks_needed(&self, prompt_tokens: usize, max_tokens: usize) -> usize {
        positions_needed(prompt_tokens, max_tokens, self.max_context_tokens)
            .div_ceil(self.block_tokens)
    }

    pub fn pool_blocks(&self) -> usize {
        self.pool_blocks
    }

    pub fn max_context_tokens(&self) -> usize {
        self.max_context_tokens
    }

    /// How many leading blocks of a prompt of `prompt_tokens` tokens (block keys `keys`) the
    /// local prefix cache would give it now (0 without one). Admission looks again: the
    /// blocks may be given up meanwhile.
    pub fn local_hits(&self, prompt_tokens: usize, keys: &[kvtier_core::BlockKey]) -> usize {
        let Some(index) = &self.local else {
            return 0;
        };
        let usable = keys
            .len()
            .min(local_limit(prompt_tokens, self.block_tokens));
        lock_index(index).hits(&keys[..usable])
    }

    /// Queues a request without waiting.
    pub fn submit(&self, req: GenRequest) -> Result<(), SubmitError> {
        self.tx.try_send(req).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SubmitError::Busy,
            mpsc::error::TrySendError::Closed(_) => SubmitError::Stopped,
        })
    }
}

/// KV positions a request can write: the prompt and every generated token but the last
/// (which is never fed back), capped by the context.
fn positions_needed(prompt: usize, max_tokens: usize, max_ctx: usize) -> usize {
    (prompt + max_tokens.saturating_sub(1))
        .min(max_ctx)
        .max(prompt)
}

struct Seq {
    req: GenRequest,
    table: BlockTable,
    sampler: Sampler,
    /// Next prompt position to compute, while prefilling.
    prefill_next: Option<usize>,
    /// The token to feed next and its position, while decoding.
    next: Option<(u32, usize)>,
    out: Vec<u32>,
    cached_tokens: usize,
    /// Leading blocks taken from the local prefix cache.
    local_blocks: usize,
    /// What was loaded, for the answer's usage.
    load: LoadReport,
    /// Positions whose K and V are in `table` (prompt and fed generated tokens).
    kv_tokens: usize,
    last_token_at: Option<Instant>,
    finished: Option<FinishReason>,
}

struct Loop {
    engine: Arc<Mutex<Engine>>,
    max_batch: usize,
    sidecar: Option<Arc<Sidecar>>,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<GenRequest>,
    running: Vec<Seq>,
    waiting: VecDeque<GenRequest>,
    local: Option<LocalCache>,
}

/// The local prefix cache and the keys it is indexed by. The index is shared with the
/// [`Scheduler`] handle (the HTTP handlers ask it what not to fetch from the sidecar); lock
/// order: the engine, then the index.
struct LocalCache {
    index: Arc<Mutex<PrefixCache>>,
    keys: BlockKeys,
}

/// Locks the index (its bookkeeping is consistent between calls, so a holder that panicked
/// left nothing half done worth refusing).
fn lock_index(index: &Mutex<PrefixCache>) -> MutexGuard<'_, PrefixCache> {
    index.lock().unwrap_or_else(|p| p.into_inner())
}

/// Leading blocks of a prompt of `len` tokens that may come from the local prefix cache:
/// whole blocks before the last token's (which is recomputed, so written, every time).
fn local_limit(len: usize, block_tokens: usize) -> usize {
    len.saturating_sub(1) / block_tokens
}

impl Loop {
    /// Gives a sequence's blocks back: to the local prefix cache when there is one (cached
    /// blocks stay), else to the pool.
    fn release(&mut self, engine: &mut Engine, table: &mut BlockTable) -> Result<()> {
        match &mut self.local {
            Some(l) => lock_index(&l.index).release_table(engine.cache_mut(), table),
            None => engine.cache_mut().release_table(table),
        }
    }

    fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.blocking_recv() {
                    Some(r) => self.waiting.push_back(r),
                    None => return,
                }
            }
            self.admit();
            if self.running.is_empty() && !self.waiting.is_empty() {
                // The head waits for blocks held outside the scheduler (see `admit`).
                std::thread::sleep(BLOCKED_POLL);
                continue;
            }
            // Only this thread sets the two gauges.
            let n = self.running.len() as i64;
            self.metrics.running.set(n);
            if n > self.metrics.peak_running.get() {
                self.metrics.peak_running.set(n);
            }
            // Every sequence advances once: a prefill chunk each, and one token for all the
            // decoding ones together (one batched forward).
            let decoding: Vec<usize> = (0..self.running.len())
                .filter(|&i| {
                    let s = &self.running[i];
                    s.finished.is_none()
                        && !s.req.events.is_closed()
                        && s.prefill_next.is_none()
                        && s.next.is_some()
                })
                .collect();
            for i in 0..self.running.len() {
                if !decoding.contains(&i) {
                    self.step(i);
                }
            }
            self.decode_together(&decoding);
            let mut i = 0;
            while i < self.running.len() {
                if self.running[i].finished.is_some() || self.running[i].req.events.is_closed() {
                    let seq = self.running.swap_remove(i);
                    self.finish(seq);
                } else {
                    i += 1;
                }
            }
            self.metrics.running.set(self.running.len() as i64);
        }
    }

    fn admit(&mut self) {
        loop {
            if self.waiting.is_empty() {
                match self.rx.try_recv() {
                    Ok(r) => self.waiting.push_back(r),
                    Err(_) => return,
                }
            }
            if self.running.len() >= self.max_batch {
                return;
            }
            let Some(front) = self.waiting.front() else {
                return;
            };
            if front.events.is_closed() {
                self.waiting.pop_front();
                self.metrics.requests.inc("cancelled");
                continue;
            }
            let held = front.prefilled.as_ref().map_or(0, |p| p.table.len());
            let shared = Arc::clone(&self.engine);
            let mut engine = lock(&shared);
            let max_ctx = engine.model().config().max_context_tokens;
            let eos = engine.eos().to_vec();
            let need = positions_needed(front.tokens.len(), front.max_tokens, max_ctx);
            let bt = engine.cache().block_tokens();
            let blocks = need.div_ceil(bt);
            let pool = engine.cache().num_blocks();
            // Leading blocks in the local prefix cache, and the pages the rest can get.
            let (hit, available) = match &self.local {
                Some(l) if front.prefilled.is_none() => {
                    let keys = &front.prefix.keys;
                    let usable = &keys[..keys.len().min(local_limit(front.tokens.len(), bt))];
                    let index = lock_index(&l.index);
                    let hit = index.hits(usable);
                    (hit, index.available(engine.cache(), &usable[..hit]))
                }
                _ => (0, engine.cache().free_blocks()),
            };
            if blocks.saturating_sub(held + hit) > available {
                drop(engine);
                if self.running.is_empty() && blocks > pool {
                    // The request can never fit (the HTTP layer refuses these before
                    // queueing; this is the backstop).
                    let req = self.waiting.pop_front().expect("front exists");
                    let _ = req.events.send(SeqEvent::Failed(format!(
                        "the request needs {blocks} KV blocks, the pool has {pool}"
                    )));
                    self.metrics.requests.inc("too_large");
                    continue;
                }
                // Running sequences free blocks as they end; blocks held outside the
                // scheduler (a remote prefill in flight, a quarantine) come back too.
                return;
            }
            let mut req = self.waiting.pop_front().expect("front exists");
            let (mut table, logits) = match req.prefilled.as_mut() {
                Some(p) => (
                    std::mem::take(&mut p.table),
                    Some(std::mem::take(&mut p.logits)),
                ),
                None => (BlockTable::new(), None),
            };
            let reserved = {
                let mut r = Ok(());
                if let Some(l) = &mut self.local
                    && req.prefilled.is_none()
                {
                    let mut index = lock_index(&l.index);
                    table = index.acquire(&req.prefix.keys[..hit]);
                    let new = blocks - hit;
                    r = index.make_room(engine.cache_mut(), new).map(|_| ());
                }
                if r.is_ok() {
                    r = engine.cache_mut().reserve(&mut table, need);
                }
                if r.is_err() {
                    let _ = self.release(&mut engine, &mut table);
                }
                r
            };
            drop(engine);
            if let Err(e) = reserved {
                let _ = req.events.send(SeqEvent::Failed(e.to_string()));
                self.metrics.requests.inc("error");
                continue;
            }
            let mut seq = Seq {
                sampler: Sampler::new(req.sampling),
                req,
                table,
                prefill_next: Some(0),
                next: None,
                out: Vec::new(),
                cached_tokens: 0,
                local_blocks: hit,
                load: LoadReport {
                    local_tokens: hit * bt,
                    ..LoadReport::default()
                },
                kv_tokens: 0,
                last_token_at: None,
                finished: None,
            };
            match logits {
                // The prompt's KV is in the table: sample the first token now.
                Some(logits) => {
                    seq.prefill_next = None;
                    seq.kv_tokens = seq.req.tokens.len();
                    Self::after_logits(&self.metrics, &mut seq, &logits, max_ctx, &eos);
                    // After the first token is out: copy the prompt's new full blocks for the
                    // sidecar, as after a local prefill.
                    if let Some(s) = &self.sidecar {
                        Self::store_blocks(&lock(&self.engine), s, &seq);
                    }
                }
                None => {
                    // The local hit first; the sidecar's blocks past it are copied in.
                    seq.cached_tokens = hit * bt;
                    seq.prefill_next = Some(hit * bt);
                    self.load_prefix(&mut seq);
                }
            }
            self.running.push(seq);
        }
    }

    /// Copies the blocks fetched from the sidecar into the request's blocks past those the
    /// local prefix cache gave it.
    fn load_prefix(&mut self, seq: &mut Seq) {
        let source = std::mem::replace(&mut seq.req.prefix.source, PrefixSource::None);
        // The source holds the blocks of keys `first..n`; the table's blocks before `from`
        // are the local prefix cache's.
        let first = seq.req.prefix.source_first;
        let n = (first + source.blocks()).min(seq.table.len());
        let from = seq.local_blocks;
        if n <= from {
            return;
        }
        if first > from {
            // The handler skipped blocks the local cache held then, and gave up since: the
            // fetched ones cannot follow a gap. Recompute from the local hit.
            tracing::debug!(
                first,
                from,
                "locally cached blocks were evicted before admission"
            );
            return;
        }
        if !source.usable() {
            self.metrics.cache_fallbacks.inc("lease_expired");
            seq.req.prefix.store_from = 0;
            return;
        }
        let t = Instant::now();
        let mut engine = lock(&self.engine);
        let mut by_tier = [0usize; 4];
        for i in from..n {
            let id = seq.table.blocks()[i];
            if let Err(e) = engine.cache_mut().write_block(id, source.block(i - first)) {
                tracing::warn!(error = %e, "cannot copy a cached block into the pool");
                self.metrics.cache_fallbacks.inc("copy_error");
                seq.req.prefix.store_from = 0;
                return;
            }
            // A block the server gave no tier for counts as DRAM (where a sidecar serves from).
            let tier = seq
                .req
                .prefix
                .tier(&source, i - first)
                .unwrap_or(kvtier_client::TierCode::Dram);
            by_tier[tier as usize] += 1;
        }
        let any_remote = by_tier[kvtier_client::TierCode::Remote as usize] > 0;
        let any_nvme = match &source {
            PrefixSource::Pinned(p) => p
                .tiers()
                .iter()
                .any(|t| *t != kvtier_client::TierCode::Dram),
            _ => false,
        };
        drop(source);
        let bytes = (n - from) * engine.cache().layout().block_bytes() as usize;
        let bt = engine.cache().block_tokens();
        drop(engine);
        let took = seq.req.prefix.fetch_time + t.elapsed();
        let block_bytes = (bytes / (n - from)) as u64;
        seq.load.loaded_tokens = by_tier.map(|b| b * bt);
        seq.load.loaded_bytes = by_tier.map(|b| b as u64 * block_bytes);
        seq.load.load_time = took;
        // The time of a load with remote blocks is mostly the cluster's fetch: no sample of
        // the sidecar's own tiers.
        if let Some(s) = self.sidecar.as_ref().filter(|_| !any_remote) {
            s.observe_load(bytes, took, any_nvme);
        }
        self.metrics.load_time.observe(took);
        add(&self.metrics.bytes_loaded, bytes as u64);
        add(&self.metrics.blocks_loaded, (n - from) as u64);
        let len = seq.req.tokens.len();
        // A full-prompt hit still computes the last token.
        seq.cached_tokens = (n * bt).min(len - 1);
        seq.prefill_next = Some(n * bt);
    }

    fn step(&mut self, i: usize) {
        let seq = &mut self.running[i];
        if seq.finished.is_some() || seq.req.events.is_closed() {
            return;
        }
        let mut engine = lock(&self.engine);
        let prefilling = seq.prefill_next.is_some();
        let r = if let Some(start) = seq.prefill_next {
            Self::prefill_step(
                &mut engine,
                self.sidecar.as_deref(),
                &self.metrics,
                seq,
                start,
            )
        } else if let Some((token, pos)) = seq.next {
            match engine.decode_step(token, pos, &mut seq.table) {
                Ok(logits) => {
                    seq.kv_tokens = pos + 1;
                    let max_ctx = engine.model().config().max_context_tokens;
                    Self::after_logits(&self.metrics, seq, &logits, max_ctx, engine.eos());
                    Ok(())
                }
                Err(e) => Err(e),
            }
        } else {
            Ok(())
        };
        drop(engine);
        // The prompt is in the cache: its full blocks join the local prefix cache (those
        // taken from it are there already).
        if r.is_ok()
            && prefilling
            && seq.prefill_next.is_none()
            && let Some(l) = &mut self.local
        {
            let full = seq.req.prefix.keys.len().min(seq.table.len());
            lock_index(&l.index).insert(&seq.req.prefix.keys[..full], &seq.table.blocks()[..full]);
        }
        if let Err(e) = r {
            tracing::error!(error = %e, "sequence failed");
            let _ = seq.req.events.send(SeqEvent::Failed(e.to_string()));
            self.metrics.requests.inc("error");
            // Marked finished; `finish` frees the blocks but sends nothing more.
            seq.finished = Some(FinishReason::Eos);
            seq.req.events = mpsc::unbounded_channel().0;
        }
    }

    /// One decode step for the sequences at `idx` in one batched forward. If the batch fails,
    /// each sequence steps alone, so one bad sequence fails only itself.
    fn decode_together(&mut self, idx: &[usize]) {
        if idx.len() <= 1 {
            for &i in idx {
                self.step(i);
            }
            return;
        }
        let steps: Vec<(u32, usize)> = idx
            .iter()
            .map(|&i| self.running[i].next.expect("a decoding sequence"))
            .collect();
        let mut tables: Vec<BlockTable> = idx
            .iter()
            .map(|&i| std::mem::take(&mut self.running[i].table))
            .collect();
        let mut engine = lock(&self.engine);
        let mut batch: Vec<(u32, usize, &mut BlockTable)> = steps
            .iter()
            .zip(tables.iter_mut())
            .map(|(&(token, pos), table)| (token, pos, table))
            .collect();
        let r = engine.decode_batch(&mut batch);
        drop(batch);
        let max_ctx = engine.model().config().max_context_tokens;
        let eos = engine.eos().to_vec();
        drop(engine);
        for (&i, table) in idx.iter().zip(tables) {
            self.running[i].table = table;
        }
        match r {
            Ok(all) => {
                add(&self.metrics.batched_decode_steps, 1);
                add(&self.metrics.batched_decode_tokens, idx.len() as u64);
                for ((&i, logits), &(_, pos)) in idx.iter().zip(all).zip(&steps) {
                    let seq = &mut self.running[i];
                    seq.kv_tokens = pos + 1;
                    Self::after_logits(&self.metrics, seq, &logits, max_ctx, &eos);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "batched decode failed; stepping each sequence alone");
                for &i in idx {
                    self.step(i);
                }
            }
        }
    }

    fn prefill_step(
        engine: &mut Engine,
        sidecar: Option<&Sidecar>,
        metrics: &Metrics,
        seq: &mut Seq,
        start: usize,
    ) -> Result<()> {
        let len = seq.req.tokens.len();
        let from = start.min(len - 1);
        let end = (from + PREFILL_CHUNK_TOKENS).min(len);
        let t = Instant::now();
        let logits = engine.prefill(&seq.req.tokens[..end], from, &mut seq.table)?;
        let took = t.elapsed();
        if let Some(s) = sidecar {
            s.observe_prefill(end - from, took);
        }
        add(&metrics.prompt_tokens_computed, (end - from) as u64);
        if end < len {
            seq.prefill_next = Some(end);
            return Ok(());
        }
        seq.prefill_next = None;
        seq.kv_tokens = len;
        let max_ctx = engine.model().config().max_context_tokens;
        Self::after_logits(metrics, seq, &logits, max_ctx, engine.eos());
        // After the first token is out: copy the new full blocks for the sidecar.
        if let Some(s) = sidecar {
            Self::store_blocks(engine, s, seq);
        }
        Ok(())
    }

    fn store_blocks(engine: &Engine, sidecar: &Sidecar, seq: &Seq) {
        let p = &seq.req.prefix;
        let full = p.keys.len().min(seq.table.len());
        if !p.store || p.store_from >= full {
            return;
        }
        let from = p.store_from;
        sidecar.queue_store(|| {
            let block = engine.cache().layout().block_bytes() as usize;
            let mut bytes = Vec::with_capacity((full - from) * block);
            for id in &seq.table.blocks()[from..full] {
                engine.cache().read_block(*id, &mut bytes).ok()?;
            }
            Some(StoreJob {
                keys: p.keys[from..full].to_vec(),
                parent: from.checked_sub(1).map(|i| p.keys[i]),
                bytes,
                retain: None,
            })
        });
    }

    /// Samples from the logits of position `len - 1` (prompt) or of the last fed token, as
    /// [`Engine::decode`] does: same stops, same order.
    fn after_logits(metrics: &Metrics, seq: &mut Seq, logits: &[f32], max_ctx: usize, eos: &[u32]) {
        let max_tokens = seq.req.max_tokens;
        if seq.out.len() >= max_tokens {
            seq.finished = Some(FinishReason::MaxTokens);
            return;
        }
        let token = seq.sampler.sample(logits);
        if eos.contains(&token) {
            seq.finished = Some(FinishReason::Eos);
            return;
        }
        seq.out.push(token);
        let now = Instant::now();
        match seq.last_token_at {
            None => metrics.ttft.observe(now - seq.req.arrived),
            Some(prev) => metrics.inter_token.observe(now - prev),
        }
        seq.last_token_at = Some(now);
        add(&metrics.generated_tokens, 1);
        let _ = seq.req.events.send(SeqEvent::Token(token));
        let pos = seq.req.tokens.len() + seq.out.len() - 1;
        if seq.out.len() >= max_tokens {
            seq.finished = Some(FinishReason::MaxTokens);
        } else if pos >= max_ctx {
            seq.finished = Some(FinishReason::ContextFull);
        } else {
            seq.next = Some((token, pos));
        }
    }

    /// The keys of a finished sequence's full blocks (prompt and generated tokens whose KV
    /// was computed: the last sampled token is never fed), when they go past the prompt's.
    fn generated_keys(&self, bt: usize, seq: &Seq) -> Option<Vec<kvtier_core::BlockKey>> {
        let p = &seq.req.prefix;
        let full = (seq.kv_tokens / bt).min(seq.table.len());
        let first = p.keys.len();
        if full <= first {
            return None;
        }
        let mut tokens = seq.req.tokens.clone();
        tokens.extend_from_slice(&seq.out);
        let made = match (&self.local, &self.sidecar) {
            (Some(l), _) => l.keys.keys(&tokens[..full * bt], p.cache_salt.as_deref()),
            (None, Some(s)) => s.keys(&tokens[..full * bt], p.cache_salt.as_deref()),
            (None, None) => return None,
        };
        match made {
            Ok(k) if k.len() == full && k[..first] == p.keys[..] => Some(k),
            Ok(_) => {
                tracing::error!("generated blocks: keys do not continue the prompt's");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot hash the generated tokens");
                None
            }
        }
    }

    /// At the end of a sequence: queues the full blocks that hold generated tokens (past the
    /// prompt's full blocks, `keys` from [`generated_keys`](Self::generated_keys)), keyed as
    /// the prompt's continuation. An agent's next prompt repeats this answer, so its blocks
    /// are then loaded instead of recomputed.
    fn store_generated(
        engine: &Engine,
        sidecar: &Sidecar,
        metrics: &Metrics,
        seq: &Seq,
        keys: &[kvtier_core::BlockKey],
    ) {
        let p = &seq.req.prefix;
        let (first, full) = (p.keys.len(), keys.len());
        if !p.store {
            return;
        }
        let queued = sidecar.queue_store(|| {
            let block = engine.cache().layout().block_bytes() as usize;
            let mut bytes = Vec::with_capacity((full - first) * block);
            for id in &seq.table.blocks()[first..full] {
                engine.cache().read_block(*id, &mut bytes).ok()?;
            }
            Some(StoreJob {
                keys: keys[first..].to_vec(),
                parent: first.checked_sub(1).map(|i| keys[i]),
                bytes,
                retain: None,
            })
        });
        if queued {
            add(&metrics.generated_blocks_queued, (full - first) as u64);
        }
    }

    fn finish(&mut self, mut seq: Seq) {
        let shared = Arc::clone(&self.engine);
        let mut engine = lock(&shared);
        let bt = engine.cache().block_tokens();
        // A sequence that ended normally (not failed, not cancelled) keeps its generated
        // blocks: stored in kvtier, and entered in the local prefix cache.
        let mut chain = None;
        if seq.finished.is_some()
            && !seq.req.events.is_closed()
            && let Some(keys) = self.generated_keys(bt, &seq)
        {
            if let Some(s) = &self.sidecar {
                Self::store_generated(&engine, s, &self.metrics, &seq, &keys);
            }
            if let Some(l) = &mut self.local {
                let first = seq.req.prefix.keys.len();
                lock_index(&l.index).insert(&keys[first..], &seq.table.blocks()[first..keys.len()]);
            }
            chain = Some(keys);
        }
        // `kvtier_retain_s`: after the response (queued behind its stores), a hint for the
        // conversation so far, prompt and answer.
        if seq.finished.is_some()
            && !seq.req.events.is_closed()
            && let (Some(s), Some(after)) = (&self.sidecar, seq.req.prefix.retain)
        {
            let keys = chain.unwrap_or_else(|| seq.req.prefix.keys.clone());
            if !keys.is_empty() && seq.req.prefix.store {
                s.queue_store(|| {
                    Some(StoreJob {
                        keys: Vec::new(),
                        parent: None,
                        bytes: Vec::new(),
                        retain: Some((keys, after)),
                    })
                });
            }
        }
        let released = self.release(&mut engine, &mut seq.table);
        drop(engine);
        if let Err(e) = released {
            tracing::error!(error = %e, "releasing a finished sequence's blocks");
        }
        let Some(finish) = seq.finished else {
            self.metrics.requests.inc("cancelled");
            return;
        };
        if seq.req.events.is_closed() {
            return;
        }
        self.metrics.e2e.observe(seq.req.arrived.elapsed());
        add(&self.metrics.prompt_tokens_cached, seq.cached_tokens as u64);
        add(
            &self.metrics.prompt_tokens_local_hit,
            (seq.local_blocks * bt) as u64,
        );
        self.metrics.requests.inc("ok");
        let _ = seq.req.events.send(SeqEvent::Done(Usage {
            finish,
            prompt_tokens: seq.req.tokens.len(),
            completion_tokens: seq.out.len(),
            cached_tokens: seq.cached_tokens,
            load: seq.load,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_case_positions() {
        // prompt + max_tokens - 1, capped by the context, never below the prompt.
        assert_eq!(positions_needed(10, 1, 100), 10);
        assert_eq!(positions_needed(10, 5, 100), 14);
        assert_eq!(positions_needed(10, 500, 100), 100);
        assert_eq!(positions_needed(100, 5, 100), 100);
    }

    #[test]
    fn unscheduled_prefilled_kv_returns_its_blocks() -> Result<()> {
        let model = crate::model::Model::random(crate::config::ModelConfig::default(), 0)?;
        let engine = Arc::new(Mutex::new(Engine::new(model, 8)?));
        let mut table = BlockTable::new();
        let logits = lock(&engine).prefill(
            &[256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            0,
            &mut table,
        )?;
        assert_eq!(table.len(), 2);
        assert_eq!(lock(&engine).cache().free_blocks(), 6);
        drop(PrefilledKv {
            table,
            logits,
            engine: Arc::clone(&engine),
        });
        assert_eq!(lock(&engine).cache().free_blocks(), 8);
        // Taken by the scheduler (an empty table), it frees nothing.
        drop(PrefilledKv {
            table: BlockTable::new(),
            logits: Vec::new(),
            engine: Arc::clone(&engine),
        });
        assert_eq!(lock(&engine).cache().free_blocks(), 8);
        Ok(())
    }
}
