//! When each request of a trace is sent, independent of what serves it.
//!
//! * Mooncake: open loop. Request `i` is due at `timestamp_ms / speedup`; at most
//!   `max_inflight` are served at once (a late request waits and its lag is recorded).
//! * Claude Code sessions: closed loop per chain. A chain's first call starts at its `t`; each
//!   next call starts when the previous one finished plus its `think_time`. A call finishes
//!   after it was served (the cache's lookup, load and store) plus its model time: the
//!   prefill of the tokens it missed and the decode of its output at the worker profile's
//!   rates. A subagent starts beside its parent chain, after the parent's preceding call
//!   finished plus the gap the recording shows between that call's end (`t + api_time`) and
//!   the subagent's `t`; the parent does not wait for it. At most `sessions` sessions run at
//!   once; the next starts when one ends.
//!
//! All waits are divided by `speedup` (none at all with an infinite speedup). Alongside real
//! time each request carries a model time (seconds, speedup 1, no serving time), used as the
//! clock of the simulations.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Result, anyhow};
use indicatif::ProgressBar;
use kvtier_core::BlockKey;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};

use super::payload::block_key;
use crate::trace::{Chain, ChainItem, MooncakeRequest, Session};

/// What serving one request found. `tiers[i]` is the tier of hit block `i`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Served {
    /// Leading blocks loaded and verified.
    pub hit_blocks: usize,
    /// The tier each hit block came from ([`kvtier_core::protocol::TierCode`] as u8).
    pub tiers: Vec<u8>,
    /// Blocks the lookup reported before the load (more than `hit_blocks` when a block went
    /// away in between or failed verification).
    pub lookup_blocks: usize,
    /// Blocks whose bytes failed verification.
    pub corrupt_blocks: usize,
    /// Blocks sent to be stored, and how many the server took (stored now or before).
    pub put_blocks: usize,
    pub stored_blocks: usize,
    /// Lookups or gets answered "busy" by the server.
    pub busy: usize,
    /// Seconds spent on lookup + load (what a worker waits for before prefill).
    pub load_s: f64,
    /// Seconds spent storing the missed blocks.
    pub store_s: f64,
    /// A fleet with failover served it elsewhere than its route picked (the pick was down
    /// or failed it).
    pub rerouted: bool,
    /// Servers of a fleet with failover that failed it before one served it.
    pub server_errors: usize,
}

/// Where retention hints come from. Claude Code sessions: after each call, from its chain.
/// Mooncake requests carry no session: their conversations are recovered from the prompts
/// ([`mooncake_turns`]), and a request's hint covers its full blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HintSource {
    /// No hints.
    #[default]
    None,
    /// The trace's own time before the chain's next call (Claude Code: its think time;
    /// Mooncake: the next turn's arrival), and no hint where there is none (what a client
    /// that knew the future would say).
    Oracle,
    /// The longest of the chain's last [`PREDICT_GAPS`] gaps (none before the chain's first
    /// gap): only the session's past, what a real client can know. A Mooncake conversation
    /// that will not come back is hinted all the same once it has had a second turn.
    Predict,
}

/// A Mooncake request's place in its conversation, recovered from the prompts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Turn {
    /// The conversation (1, 2, ... in order of first request).
    pub session: u64,
    /// The request's full blocks (a hint covers these: a next turn rewrites a partial one).
    pub full_blocks: usize,
    /// Seconds until the next request that continues this one, if any (the oracle).
    pub next_s: Option<f64>,
    /// The longest of the last [`PREDICT_GAPS`] gaps between the conversation's turns up to
    /// this request (the predictor; none at its first turn).
    pub predicted_s: Option<f64>,
}

/// The conversations of a Mooncake trace. A request continues the latest earlier request
/// whose full blocks are a prefix of its prompt, at least two blocks long (one shared block
/// is a system prompt, not a conversation); Mooncake's ids name a block with its whole prefix,
/// so one id finds it. A request that continues none starts a conversation.
pub fn mooncake_turns(requests: &[MooncakeRequest]) -> Vec<Turn> {
    // The id of each request's last full block -> the latest request ending there.
    let mut ends: HashMap<u64, usize> = HashMap::new();
    let mut turns: Vec<Turn> = Vec::with_capacity(requests.len());
    // Each request's predecessor, and the gap to it in seconds.
    let mut back: Vec<Option<(usize, f64)>> = Vec::with_capacity(requests.len());
    let mut sessions = 0u64;
    for (j, r) in requests.iter().enumerate() {
        let at = |i: usize| requests[i].timestamp_ms as f64 / 1000.0;
        let pred = (2..=r.hash_ids.len())
            .rev()
            .find_map(|k| ends.get(&r.hash_ids[k - 1]).copied());
        let link = pred.map(|i| (i, (at(j) - at(i)).max(0.0)));
        back.push(link);
        let session = match link {
            Some((i, gap)) => {
                turns[i].next_s.get_or_insert(gap);
                turns[i].session
            }
            None => {
                sessions += 1;
                sessions
            }
        };
        // The gaps of this request's conversation up to it, the latest first.
        let past = std::iter::successors(link, |&(p, _)| back[p]).map(|(_, gap)| gap);
        let full_blocks = r.blocks_to_store(true);
        turns.push(Turn {
            session,
            full_blocks,
            next_s: None,
            predicted_s: predict(past),
        });
        if full_blocks >= 2 {
            ends.insert(r.hash_ids[full_blocks - 1], j);
        }
    }
    turns
}

/// Past gaps the predictor looks at.
pub const PREDICT_GAPS: usize = 3;

/// The predictor's expected return: the longest of the last [`PREDICT_GAPS`] gaps (`past`,
/// the latest first); none before the first gap.
fn predict(past: impl Iterator<Item = f64>) -> Option<f64> {
    past.take(PREDICT_GAPS).reduce(f64::max)
}

/// Serves requests: a real server through the client, or a fake in tests.
pub trait Backend: Send + Sync + 'static {
    /// Serves one request: `keys` in chain order, of which the first `blocks_to_store`
    /// are stored after the request (the missing ones).
    fn serve(
        &self,
        keys: Vec<BlockKey>,
        blocks_to_store: usize,
    ) -> impl Future<Output = Result<Served>> + Send;

    /// Tells the server that `keys` (a chain's prompt) will be looked up again in about
    /// `expected_return` (already divided by the speedup); returns whether it was accepted.
    fn retain(
        &self,
        session: u64,
        keys: Vec<BlockKey>,
        expected_return: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        let _ = (session, keys, expected_return);
        async { Ok(false) }
    }
}

/// The worker's speed: what a call's model time is made of.
#[derive(Clone, Copy, Debug)]
pub struct WorkerProfile {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

impl WorkerProfile {
    /// Model seconds of a call that missed `missed_tokens` and decodes `output_tokens`.
    pub fn service_s(&self, missed_tokens: u64, output_tokens: u64) -> f64 {
        missed_tokens as f64 / self.prefill_tok_s + output_tokens as f64 / self.decode_tok_s
    }
}

/// How the schedule runs.
#[derive(Clone, Debug)]
pub struct ScheduleConfig {
    /// Trace time is divided by this; `None` = no waits at all.
    pub speedup: Option<f64>,
    pub max_inflight: usize,
    /// Sessions at once (Claude Code).
    pub sessions: usize,
    pub block_tokens: u32,
    pub worker: WorkerProfile,
    /// Seed of the block keys.
    pub seed: u64,
    /// Retention hints after each call of a session.
    pub hints: HintSource,
}

/// One request as it was served.
#[derive(Clone, Debug)]
pub struct Record {
    /// Order in which serving began (0, 1, 2, ...).
    pub seq: u64,
    /// Scope of the ids (0 for Mooncake, 1 + session copy for sessions).
    pub scope: u32,
    pub ids: Vec<u64>,
    pub blocks_to_store: usize,
    pub input_tokens: u64,
    /// Real time since the replay started: due, serving began, finished (model time
    /// included).
    pub due: Duration,
    pub start: Duration,
    pub finish: Duration,
    /// Model time at which it was due, seconds.
    pub model_due_s: f64,
    pub served: Served,
}

impl Record {
    /// Prompt tokens the hit blocks cover.
    pub fn hit_tokens(&self, block_tokens: u32) -> u64 {
        (self.served.hit_blocks as u64 * u64::from(block_tokens)).min(self.input_tokens)
    }
}

struct Engine<B> {
    backend: Arc<B>,
    cfg: ScheduleConfig,
    t0: Instant,
    inflight: Arc<Semaphore>,
    seq: AtomicU64,
    records: Mutex<Vec<Record>>,
    abort: AtomicBool,
    first_error: Mutex<Option<anyhow::Error>>,
    progress: Option<ProgressBar>,
    next_chain: AtomicU64,
}

/// A request ready to be served.
struct Job {
    scope: u32,
    ids: Vec<u64>,
    blocks_to_store: usize,
    input_tokens: u64,
    output_tokens: u64,
    due: Instant,
    model_due_s: f64,
}

impl<B: Backend> Engine<B> {
    fn new(backend: Arc<B>, cfg: ScheduleConfig, progress: Option<ProgressBar>) -> Arc<Self> {
        Arc::new(Self {
            backend,
            inflight: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            cfg,
            t0: Instant::now(),
            seq: AtomicU64::new(0),
            records: Mutex::new(Vec::new()),
            abort: AtomicBool::new(false),
            first_error: Mutex::new(None),
            progress,
            next_chain: AtomicU64::new(1),
        })
    }

    fn scaled(&self, model_s: f64) -> Duration {
        match self.cfg.speedup {
            None => Duration::ZERO,
            Some(s) => Duration::from_secs_f64((model_s / s).max(0.0)),
        }
    }

    fn fail(&self, e: anyhow::Error) {
        self.abort.store(true, Ordering::Release);
        let mut g = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(e);
    }

    fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }

    /// Serves `job` (after its due time, within the in-flight bound); returns its record's
    /// served part and when serving ended.
    async fn serve(
        &self,
        job: Job,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<(Served, Instant)> {
        sleep_until(job.due).await;
        let _permit = match permit {
            Some(p) => p,
            None => self
                .inflight
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| anyhow!("replay stopped"))?,
        };
        if self.aborted() {
            return Err(anyhow!("replay stopped"));
        }
        let start = Instant::now();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let keys = job
            .ids
            .iter()
            .map(|&id| block_key(self.cfg.seed, job.scope, id))
            .collect();
        let served = self.backend.serve(keys, job.blocks_to_store).await?;
        let done = Instant::now();
        let missed = job
            .input_tokens
            .saturating_sub(served.hit_blocks as u64 * u64::from(self.cfg.block_tokens));
        let finish = done
            + self.scaled(
                self.cfg
                    .worker
                    .service_s(missed, job.output_tokens)
                    .max(0.0),
            );
        let rec = Record {
            seq,
            scope: job.scope,
            ids: job.ids,
            blocks_to_store: job.blocks_to_store,
            input_tokens: job.input_tokens,
            due: job.due - self.t0,
            start: start - self.t0,
            finish: finish - self.t0,
            model_due_s: job.model_due_s,
            served: served.clone(),
        };
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rec);
        if let Some(pb) = &self.progress {
            pb.inc(1);
        }
        Ok((served, finish))
    }

    /// Sends a hint for `ids` (in `scope`) expected back in `model_s` trace seconds.
    async fn hint(&self, session: u64, scope: u32, ids: &[u64], model_s: f64) -> Result<()> {
        let keys = ids
            .iter()
            .map(|&id| block_key(self.cfg.seed, scope, id))
            .collect();
        // In real time, as every wait of the replay: the same requests fall in the hold at
        // any speed. Without waits (speedup max) a hint covers nothing.
        self.backend
            .retain(session, keys, self.scaled(model_s))
            .await?;
        Ok(())
    }

    fn finish(self: Arc<Self>) -> Result<Vec<Record>> {
        if let Some(e) = self
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Err(e);
        }
        let mut records =
            std::mem::take(&mut *self.records.lock().unwrap_or_else(|p| p.into_inner()));
        records.sort_by_key(|r| r.seq);
        Ok(records)
    }
}

/// Replays Mooncake requests open loop; returns the records in serving order.
pub async fn run_mooncake<B: Backend>(
    backend: Arc<B>,
    requests: &[MooncakeRequest],
    full_blocks_only: bool,
    cfg: ScheduleConfig,
    progress: Option<ProgressBar>,
) -> Result<Vec<Record>> {
    let turns = match cfg.hints {
        HintSource::None => Vec::new(),
        HintSource::Oracle | HintSource::Predict => mooncake_turns(requests),
    };
    let e = Engine::new(backend, cfg, progress);
    let mut tasks = JoinSet::new();
    for (i, r) in requests.iter().enumerate() {
        if e.aborted() {
            break;
        }
        let model_due_s = r.timestamp_ms as f64 / 1000.0;
        let due = e.t0 + e.scaled(model_due_s);
        // Wait here for the due time and a free slot, so tasks are not queued without bound.
        sleep_until(due).await;
        let permit = e
            .inflight
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| anyhow!("replay stopped"))?;
        let job = Job {
            scope: 0,
            ids: r.hash_ids.clone(),
            blocks_to_store: r.blocks_to_store(full_blocks_only),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            due,
            model_due_s,
        };
        // After the response, as a chat client would: the conversation's prefix will be
        // wanted again at its next turn.
        let hint = turns.get(i).and_then(|t| {
            let s = match e.cfg.hints {
                HintSource::None => None,
                HintSource::Oracle => t.next_s,
                HintSource::Predict => t.predicted_s,
            }?;
            (t.full_blocks > 0).then(|| (t.session, r.hash_ids[..t.full_blocks].to_vec(), s))
        });
        let e2 = e.clone();
        tasks.spawn(async move {
            let served = match (e2.serve(job, Some(permit)).await, hint) {
                (Ok((_, finish)), Some((session, ids, s))) => {
                    sleep_until(finish).await;
                    e2.hint(session, 0, &ids, s).await
                }
                (Ok(_), None) => Ok(()),
                (Err(err), _) => Err(err),
            };
            if let Err(err) = served {
                e2.fail(err);
            }
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    e.finish()
}

/// Replays sessions (each `copies` times, each copy its own id scope) closed loop per
/// chain; returns the records in serving order.
pub async fn run_sessions<B: Backend>(
    backend: Arc<B>,
    sessions: &[Session],
    copies: u32,
    cfg: ScheduleConfig,
    progress: Option<ProgressBar>,
) -> Result<Vec<Record>> {
    let e = Engine::new(backend, cfg, progress);
    let slots = Arc::new(Semaphore::new(e.cfg.sessions.max(1)));
    let mut tasks = JoinSet::new();
    let mut scope = 0u32;
    // Model time at which the next session starts: when the one whose slot it takes ended.
    let model_clock = Arc::new(Mutex::new(0.0f64));
    for _ in 0..copies {
        for s in sessions {
            scope += 1;
            let permit = slots
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| anyhow!("replay stopped"))?;
            if e.aborted() {
                break;
            }
            let (e2, chain, clock) = (e.clone(), Arc::new(s.chain.clone()), model_clock.clone());
            let model_start = *model_clock.lock().unwrap_or_else(|p| p.into_inner());
            tasks.spawn(async move {
                match run_chain(e2.clone(), chain, scope, Instant::now(), model_start).await {
                    Ok(end) => {
                        let mut c = clock.lock().unwrap_or_else(|p| p.into_inner());
                        *c = c.max(end);
                    }
                    Err(err) => e2.fail(err),
                }
                drop(permit);
            });
            while tasks.try_join_next().is_some() {}
        }
    }
    while tasks.join_next().await.is_some() {}
    e.finish()
}

type ChainFuture = Pin<Box<dyn Future<Output = Result<f64>> + Send>>;

/// Runs one chain from `start` (real) / `model_start` (model seconds); subagents are spawned
/// beside it and awaited before it returns. Returns the model time its last call ended.
fn run_chain<B: Backend>(
    e: Arc<Engine<B>>,
    chain: Arc<Chain>,
    scope: u32,
    start: Instant,
    model_start: f64,
) -> ChainFuture {
    Box::pin(async move {
        let mut subagents = JoinSet::new();
        // (real finish, model finish, recorded end) of the previous call.
        let mut prev: Option<(Instant, f64, f64)> = None;
        let mut model_end = model_start;
        let session = e.next_chain.fetch_add(1, Ordering::Relaxed);
        // Think times seen so far (the predictor's only input).
        let mut gaps: Vec<f64> = Vec::new();
        for (i, item) in chain.items.iter().enumerate() {
            if e.aborted() {
                break;
            }
            match item {
                ChainItem::Call(c) => {
                    let (due, model_due_s) = match prev {
                        None => (start + e.scaled(c.t_s), model_start + c.t_s),
                        Some((f, mf, _)) => {
                            gaps.push(c.think_time_s);
                            (f + e.scaled(c.think_time_s), mf + c.think_time_s)
                        }
                    };
                    let job = Job {
                        scope,
                        ids: c.hash_ids.clone(),
                        blocks_to_store: c.hash_ids.len(),
                        input_tokens: c.input_tokens,
                        output_tokens: c.output_tokens,
                        due,
                        model_due_s,
                    };
                    let (served, finish) = e.serve(job, None).await?;
                    let missed = c
                        .input_tokens
                        .saturating_sub(served.hit_blocks as u64 * u64::from(e.cfg.block_tokens));
                    let model_finish =
                        model_due_s + e.cfg.worker.service_s(missed, c.output_tokens);
                    sleep_until(finish).await;
                    // After the response: the prefix will be wanted again at the next call.
                    let next_call = chain.items[i + 1..].iter().find_map(|it| match it {
                        ChainItem::Call(n) => Some(n),
                        ChainItem::Subagent(_) => None,
                    });
                    let expected = match (e.cfg.hints, next_call) {
                        (HintSource::None, _) | (_, None) => None,
                        (HintSource::Oracle, Some(n)) => Some(n.think_time_s),
                        (HintSource::Predict, Some(_)) => predict(gaps.iter().rev().copied()),
                    };
                    if let Some(s) = expected {
                        e.hint(session, scope, &c.hash_ids, s.max(0.0)).await?;
                    }
                    model_end = model_end.max(model_finish);
                    prev = Some((finish, model_finish, c.t_s + c.api_time_s.unwrap_or(0.0)));
                }
                ChainItem::Subagent(s) => {
                    let (sub_start, sub_model) = match prev {
                        None => (start + e.scaled(s.t_s), model_start + s.t_s),
                        Some((f, mf, recorded_end)) => {
                            let gap = (s.t_s - recorded_end).max(0.0);
                            (f + e.scaled(gap), mf + gap)
                        }
                    };
                    let sub = Arc::new(s.chain.clone());
                    let e2 = e.clone();
                    subagents.spawn(async move {
                        sleep_until(sub_start).await;
                        run_chain(e2, sub, scope, sub_start, sub_model).await
                    });
                }
            }
        }
        while let Some(r) = subagents.join_next().await {
            let end = r.map_err(|j| anyhow!("subagent task failed: {j}"))??;
            model_end = model_end.max(end);
        }
        Ok(model_end)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{ModelCall, Subagent};

    /// Serves instantly: no hits, everything stored.
    struct Instant0;

    impl Backend for Instant0 {
        async fn serve(&self, _keys: Vec<BlockKey>, blocks_to_store: usize) -> Result<Served> {
            Ok(Served {
                put_blocks: blocks_to_store,
                stored_blocks: blocks_to_store,
                ..Served::default()
            })
        }
    }

    fn call(t_s: f64, input: u64, out: u64, ids: &[u64], api: f64, think: f64) -> ChainItem {
        ChainItem::Call(ModelCall {
            t_s,
            input_tokens: input,
            output_tokens: out,
            hash_ids: ids.to_vec(),
            api_time_s: Some(api),
            think_time_s: think,
        })
    }

    fn cfg(speedup: Option<f64>) -> ScheduleConfig {
        ScheduleConfig {
            speedup,
            max_inflight: 4,
            sessions: 4,
            block_tokens: 64,
            worker: WorkerProfile {
                prefill_tok_s: 100.0,
                decode_tok_s: 10.0,
            },
            seed: 1,
            hints: HintSource::None,
        }
    }

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[tokio::test(start_paused = true)]
    async fn a_chain_waits_for_its_previous_call_and_subagents_run_beside_it() {
        // Call A (t 0): 130 tokens missed + 10 out = 1.3 + 1.0 = 2.3 s of model time; the
        // recording says it ended at 2.0. The subagent (t 5) starts 3 s after A finished;
        // its call S takes 0.64 + 0.5 = 1.14 s. Call C starts 4 s (think) after A finished,
        // while S is still running.
        let session = Session {
            path: "s.json".into(),
            id: "s".into(),
            block_tokens: 64,
            harness_tokens: 0,
            chain: Chain {
                items: vec![
                    call(0.0, 130, 10, &[0, 1], 2.0, 0.0),
                    ChainItem::Subagent(Subagent {
                        t_s: 5.0,
                        agent_id: "a".into(),
                        duration_s: 0.0,
                        harness_tokens: 0,
                        chain: Chain {
                            items: vec![call(0.0, 64, 5, &[7], 1.0, 0.0)],
                        },
                    }),
                    call(6.0, 200, 10, &[0, 1, 2], 1.0, 4.0),
                ],
            },
        };
        let r = run_sessions(Arc::new(Instant0), &[session], 1, cfg(Some(1.0)), None)
            .await
            .unwrap();
        assert_eq!(r.len(), 3);
        let by_ids = |ids: &[u64]| r.iter().find(|x| x.ids == ids).unwrap();
        let (a, s, c) = (by_ids(&[0, 1]), by_ids(&[7]), by_ids(&[0, 1, 2]));
        let close = |x: f64, y: f64| (x - y).abs() < 1e-3;
        assert!(close(secs(a.start), 0.0), "{a:?}");
        assert!(close(secs(a.finish), 2.3), "{a:?}");
        assert!(close(secs(s.start), 2.3 + 3.0), "{s:?}");
        assert!(close(secs(s.finish), 5.3 + 1.14), "{s:?}");
        assert!(close(secs(c.start), 2.3 + 4.0), "{c:?}");
        // Beside: C starts while S runs.
        assert!(s.start < c.start && c.start < s.finish);
        assert_eq!((a.seq, s.seq, c.seq), (0, 1, 2));
        assert!(close(c.model_due_s, 6.3) && close(s.model_due_s, 5.3));
    }

    #[tokio::test(start_paused = true)]
    async fn mooncake_requests_arrive_at_their_timestamps_scaled() {
        let req = |ts: u64, ids: &[u64]| MooncakeRequest {
            timestamp_ms: ts,
            input_tokens: ids.len() as u64 * 512,
            output_tokens: 1,
            hash_ids: ids.to_vec(),
        };
        let trace = [req(0, &[0]), req(1000, &[0, 1]), req(4000, &[2])];
        let r = run_mooncake(Arc::new(Instant0), &trace, false, cfg(Some(2.0)), None)
            .await
            .unwrap();
        let starts: Vec<f64> = r.iter().map(|x| secs(x.start)).collect();
        assert!(
            (starts[1] - 0.5).abs() < 1e-3 && (starts[2] - 2.0).abs() < 1e-3,
            "{starts:?}"
        );
        assert_eq!(r[2].model_due_s, 4.0);
        // No waits at all with an infinite speedup.
        let r = run_mooncake(Arc::new(Instant0), &trace, false, cfg(None), None)
            .await
            .unwrap();
        assert!(r.iter().all(|x| x.start == Duration::ZERO));
        assert_eq!(r.len(), 3);
    }

    /// Serves instantly and records the hints: (session, blocks, expected return in s).
    #[derive(Default)]
    struct Hints(Mutex<Vec<(u64, usize, f64)>>);

    impl Backend for Hints {
        async fn serve(&self, keys: Vec<BlockKey>, n: usize) -> Result<Served> {
            Instant0.serve(keys, n).await
        }

        async fn retain(&self, session: u64, keys: Vec<BlockKey>, ret: Duration) -> Result<bool> {
            let mut g = self.0.lock().unwrap();
            g.push((session, keys.len(), ret.as_secs_f64()));
            Ok(true)
        }
    }

    /// Think times 0, 4, 10, 1 before calls A, B, C, D; at speedup 2. The oracle hints after
    /// A, B and C the next call's think time (halved); the predictor the longest of the
    /// gaps seen so far (none after A, which has none); neither after the last call.
    #[tokio::test(start_paused = true)]
    async fn hints_carry_the_oracle_or_the_predicted_return() {
        let session = Session {
            path: "s.json".into(),
            id: "s".into(),
            block_tokens: 64,
            harness_tokens: 0,
            chain: Chain {
                items: vec![
                    call(0.0, 64, 1, &[0], 1.0, 0.0),
                    call(5.0, 128, 1, &[0, 1], 1.0, 4.0),
                    call(16.0, 192, 1, &[0, 1, 2], 1.0, 10.0),
                    call(18.0, 256, 1, &[0, 1, 2, 3], 1.0, 1.0),
                ],
            },
        };
        let run = |hints: HintSource| {
            let session = session.clone();
            async move {
                let b = Arc::new(Hints::default());
                let c = ScheduleConfig {
                    hints,
                    ..cfg(Some(2.0))
                };
                run_sessions(b.clone(), &[session], 1, c, None)
                    .await
                    .unwrap();
                let g = b.0.lock().unwrap();
                g.iter().map(|&(_, n, s)| (n, s)).collect::<Vec<_>>()
            }
        };
        assert_eq!(run(HintSource::None).await, vec![]);
        assert_eq!(
            run(HintSource::Oracle).await,
            vec![(1, 2.0), (2, 5.0), (3, 0.5)]
        );
        assert_eq!(run(HintSource::Predict).await, vec![(2, 2.0), (3, 5.0)]);
    }

    /// Six requests: a conversation of four turns (the fourth a second answer to the
    /// second, with no partial block), one of a single turn, and a one-block prompt.
    fn conversations() -> Vec<MooncakeRequest> {
        let req = |t_s: u64, ids: &[u64], partial: bool| MooncakeRequest {
            timestamp_ms: t_s * 1000,
            input_tokens: ids.len() as u64 * 512 - u64::from(partial) * 100,
            output_tokens: 1,
            hash_ids: ids.to_vec(),
        };
        vec![
            req(0, &[0, 1, 2], true),
            req(10, &[0, 1, 3, 4], true),
            req(12, &[0, 5, 6], true),
            req(40, &[0, 1, 3, 7, 8], true),
            req(41, &[0, 1, 3, 9], false),
            req(50, &[0], true),
        ]
    }

    #[test]
    fn mooncake_conversations_are_recovered_from_the_prompts() {
        let t = mooncake_turns(&conversations());
        let got: Vec<_> = t
            .iter()
            .map(|t| (t.session, t.full_blocks, t.next_s, t.predicted_s))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 2, Some(10.0), None),
                (1, 3, Some(30.0), Some(10.0)),
                // The shared first block alone does not continue a conversation.
                (2, 2, None, None),
                (1, 4, None, Some(30.0)),
                // A second answer to turn 2 continues it too; the oracle of turn 2 is its
                // first continuation.
                (1, 4, None, Some(31.0)),
                (3, 0, None, None),
            ]
        );
    }

    /// At speedup 2: the oracle hints the next turn's arrival after the two turns that have
    /// one; the predictor the longest past gap after every turn that has a past; both over
    /// the full blocks only, and nothing for a prompt without one.
    #[tokio::test(start_paused = true)]
    async fn mooncake_hints_follow_the_recovered_conversations() {
        let run = |hints: HintSource| async move {
            let b = Arc::new(Hints::default());
            let c = ScheduleConfig {
                hints,
                ..cfg(Some(2.0))
            };
            run_mooncake(b.clone(), &conversations(), false, c, None)
                .await
                .unwrap();
            let mut g = b.0.lock().unwrap().clone();
            g.sort_by(|x, y| x.partial_cmp(y).unwrap());
            g
        };
        assert_eq!(run(HintSource::None).await, vec![]);
        assert_eq!(
            run(HintSource::Oracle).await,
            vec![(1, 2, 5.0), (1, 3, 15.0)]
        );
        assert_eq!(
            run(HintSource::Predict).await,
            vec![(1, 3, 5.0), (1, 4, 15.0), (1, 4, 15.5)]
        );
    }

    struct Failing;

    impl Backend for Failing {
        async fn serve(&self, _keys: Vec<BlockKey>, _n: usize) -> Result<Served> {
            Err(anyhow!("server went away"))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_backend_error_stops_the_replay() {
        let trace: Vec<MooncakeRequest> = (0..100)
            .map(|i| MooncakeRequest {
                timestamp_ms: i,
                input_tokens: 512,
                output_tokens: 1,
                hash_ids: vec![i],
            })
            .collect();
        let e = run_mooncake(Arc::new(Failing), &trace, false, cfg(None), None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("server went away"), "{e}");
    }
}
