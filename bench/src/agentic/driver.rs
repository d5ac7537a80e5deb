//! Drives a workload against one endpoint, closed-loop: `concurrency` session loops, each
//! taking the next session when its current one ends (think gaps included, as a user's agent
//! holds its seat while a tool runs). Subagents run beside their parent as their own tasks.

use std::collections::HashSet;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use serde::Serialize;
use tokio::task::JoinSet;

use super::http::{CompletionClient, Endpoint, Timeouts};
use super::workload::{Base, Chain, Content, Step, Workload};

/// Tokens per block when counting the ideal prefix reuse (the reference worker's block size).
pub const REUSE_BLOCK_TOKENS: usize = 16;

/// How prompts go on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum PromptFormat {
    /// An array of token ids (every id below 256).
    Tokens,
    /// A string (the same bytes; for engines with their own tokenizer).
    Text,
    /// English text, one word per workload token (sentences of a coding agent's transcript):
    /// for engines with a real tokenizer, where a word is about one token.
    English,
}

impl PromptFormat {
    /// What the generated content is made of in this format.
    pub fn content(self) -> Content {
        match self {
            PromptFormat::Tokens | PromptFormat::Text => Content::Letters,
            PromptFormat::English => Content::English,
        }
    }
}

/// A prompt's workload tokens: its bytes, or with [`Content::English`] its words (each with
/// the space before it).
pub fn units(prompt: &[u8], content: Content) -> Vec<&[u8]> {
    match content {
        Content::Letters => prompt.chunks(1).collect(),
        Content::English => {
            let mut v = Vec::new();
            let mut start = 0;
            for (i, b) in prompt.iter().enumerate() {
                if *b == b' ' && i > start {
                    v.push(&prompt[start..i]);
                    start = i;
                }
            }
            if start < prompt.len() {
                v.push(&prompt[start..]);
            }
            v
        }
    }
}

#[derive(Clone, Debug)]
pub struct DriveOptions {
    pub concurrency: usize,
    /// Real seconds per workload second of think gaps.
    pub time_scale: f64,
    pub model: String,
    pub prompt_format: PromptFormat,
    pub timeouts: Timeouts,
    pub api_key: Option<String>,
    /// Stop the run after this many failed requests.
    pub max_errors: usize,
    pub progress: bool,
}

/// Which kind of turn a request was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum TurnKind {
    /// The first turn of a session (harness prefix possibly cached, the rest new).
    First,
    /// A later main-chain turn after a short gap.
    Warm,
    /// A main-chain turn after a gap of at least `long_idle_s`.
    AfterIdle,
    /// A subagent's turn.
    Subagent,
}

/// One request as measured.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub session: usize,
    /// 0 for the main chain; subagents count up from 1 within the run.
    pub chain: usize,
    /// Index of the turn in its chain.
    pub turn: usize,
    pub kind: TurnKind,
    pub prompt_tokens: usize,
    /// Leading tokens (whole 16-token blocks) also at the start of an earlier prompt of the run.
    pub reusable_tokens: usize,
    pub max_tokens: u32,
    /// Send time since the run's start.
    pub start_s: f64,
    pub outcome: Result<Measured, String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Measured {
    pub ttft_ms: f64,
    pub itl_ms: Vec<f64>,
    pub e2e_ms: f64,
    pub output_tokens: u64,
    pub usage_prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// Everything one run produced.
#[derive(Debug)]
pub struct RunData {
    pub records: Vec<Record>,
    pub wall: Duration,
    pub peak_inflight: usize,
    pub peak_sessions: usize,
    /// Why the run stopped early, if it did.
    pub aborted: Option<String>,
}

struct Shared {
    client: CompletionClient,
    o: DriveOptions,
    long_idle_s: f64,
    harness: Vec<u8>,
    start: Instant,
    records: Mutex<Vec<Record>>,
    seen_blocks: Mutex<HashSet<u64>>,
    errors: AtomicUsize,
    abort: AtomicBool,
    inflight: AtomicUsize,
    peak_inflight: AtomicUsize,
    chains: AtomicUsize,
    bar: Option<ProgressBar>,
}

/// Runs `w` against `ep`. Fails fast (within the connect timeout) when the endpoint does not
/// accept connections.
pub async fn drive(w: &Workload, ep: &Endpoint, o: &DriveOptions) -> anyhow::Result<RunData> {
    if o.concurrency == 0 {
        anyhow::bail!("--concurrency must be at least 1");
    }
    if !(o.time_scale.is_finite() && o.time_scale >= 0.0) {
        anyhow::bail!("--time-scale must be a number >= 0, not {}", o.time_scale);
    }
    let client = CompletionClient::new(ep, o.api_key.as_deref(), o.timeouts);
    client.probe().await.map_err(|e| {
        anyhow::anyhow!(
            "endpoint {} is unreachable: {e} (is the server running and listening there?)",
            ep.url()
        )
    })?;
    let harness_len = w
        .sessions
        .iter()
        .flat_map(|s| harness_lengths(&s.main))
        .max()
        .unwrap_or(0);
    let bar = o
        .progress
        .then(|| crate::report::bar(w.turns() as u64, &format!("turns {}", ep.url())));
    let sh = Arc::new(Shared {
        client,
        o: o.clone(),
        long_idle_s: w.long_idle_s,
        harness: w.harness(harness_len, o.prompt_format.content()),
        start: Instant::now(),
        records: Mutex::new(Vec::new()),
        seen_blocks: Mutex::new(HashSet::new()),
        errors: AtomicUsize::new(0),
        abort: AtomicBool::new(false),
        inflight: AtomicUsize::new(0),
        peak_inflight: AtomicUsize::new(0),
        chains: AtomicUsize::new(1),
        bar,
    });
    let sessions = Arc::new(w.sessions.clone());
    let next = Arc::new(AtomicUsize::new(0));
    let active = Arc::new(AtomicUsize::new(0));
    let peak_sessions = Arc::new(AtomicUsize::new(0));
    let mut loops = JoinSet::new();
    for _ in 0..o.concurrency.min(sessions.len().max(1)) {
        let (sh, sessions, next) = (sh.clone(), sessions.clone(), next.clone());
        let (active, peak) = (active.clone(), peak_sessions.clone());
        loops.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= sessions.len() || sh.abort.load(Ordering::Relaxed) {
                    break;
                }
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let s = &sessions[i];
                let ctx = base_context(&sh, &s.main.base, &[]);
                run_chain(sh.clone(), s.id, 0, s.main.clone(), ctx).await;
                active.fetch_sub(1, Ordering::SeqCst);
            }
        });
    }
    while let Some(r) = loops.join_next().await {
        r.map_err(|e| anyhow::anyhow!("a session loop failed: {e}"))?;
    }
    let wall = sh.start.elapsed();
    if let Some(b) = &sh.bar {
        b.finish_and_clear();
    }
    let errors = sh.errors.load(Ordering::Relaxed);
    let aborted = sh.abort.load(Ordering::Relaxed).then(|| {
        format!(
            "stopped after {errors} failed requests (--max-errors {})",
            o.max_errors
        )
    });
    let mut records = std::mem::take(&mut *lock(&sh.records));
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    Ok(RunData {
        records,
        wall,
        peak_inflight: sh.peak_inflight.load(Ordering::SeqCst),
        peak_sessions: peak_sessions.load(Ordering::SeqCst),
        aborted,
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave them inconsistent (push/insert only).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn harness_lengths(c: &Chain) -> Vec<usize> {
    let mut v = Vec::new();
    if let Base::Harness(n) = c.base {
        v.push(n);
    }
    for s in &c.steps {
        if let Step::Spawn(subs) = s {
            for sc in subs {
                v.extend(harness_lengths(sc));
            }
        }
    }
    v
}

fn base_context(sh: &Shared, base: &Base, parent: &[u8]) -> Vec<u8> {
    match base {
        Base::Harness(n) => {
            let bytes: usize = units(&sh.harness, sh.o.prompt_format.content())
                .iter()
                .take(*n)
                .map(|u| u.len())
                .sum();
            sh.harness[..bytes].to_vec()
        }
        Base::Parent => parent.to_vec(),
    }
}

fn run_chain(
    sh: Arc<Shared>,
    session: usize,
    chain_id: usize,
    chain: Chain,
    mut ctx: Vec<u8>,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        let mut subs = JoinSet::new();
        let mut turn = 0usize;
        for step in chain.steps {
            match step {
                Step::Turn {
                    gap_s,
                    append,
                    max_tokens,
                } => {
                    if sh.abort.load(Ordering::Relaxed) {
                        break;
                    }
                    let pause = gap_s * sh.o.time_scale;
                    if pause > 0.0 {
                        tokio::time::sleep(Duration::from_secs_f64(pause)).await;
                    }
                    append.extend(sh.o.prompt_format.content(), &mut ctx);
                    let kind = if chain_id != 0 {
                        TurnKind::Subagent
                    } else if turn == 0 {
                        TurnKind::First
                    } else if gap_s >= sh.long_idle_s {
                        TurnKind::AfterIdle
                    } else {
                        TurnKind::Warm
                    };
                    request(&sh, session, chain_id, turn, kind, &ctx, max_tokens).await;
                    turn += 1;
                }
                Step::Spawn(chains) => {
                    for c in chains {
                        let id = sh.chains.fetch_add(1, Ordering::Relaxed);
                        let base = base_context(&sh, &c.base, &ctx);
                        subs.spawn(run_chain(sh.clone(), session, id, c, base));
                    }
                }
                Step::Join { append } => {
                    while subs.join_next().await.is_some() {}
                    append.extend(sh.o.prompt_format.content(), &mut ctx);
                }
            }
        }
        while subs.join_next().await.is_some() {}
    })
}

/// Leading tokens of `prompt` (whole blocks) seen at the start of an earlier prompt; records
/// this prompt's blocks.
fn reusable(sh: &Shared, prompt: &[&[u8]]) -> usize {
    let mut h = DefaultHasher::new();
    let hashes: Vec<u64> = prompt
        .chunks_exact(REUSE_BLOCK_TOKENS)
        .map(|b| {
            b.hash(&mut h);
            h.finish()
        })
        .collect();
    let mut seen = lock(&sh.seen_blocks);
    let hit = hashes.iter().take_while(|k| seen.contains(k)).count();
    seen.extend(hashes);
    hit * REUSE_BLOCK_TOKENS
}

/// The request body for a prompt.
///
/// `user` names the session (OpenAI's end-user field), so a session-sticky router can keep a
/// session on one worker; engines ignore it.
pub fn body(
    model: &str,
    prompt: &[u8],
    max_tokens: u32,
    format: PromptFormat,
    session: usize,
) -> Vec<u8> {
    let prompt = match format {
        PromptFormat::Tokens => serde_json::Value::from(
            prompt
                .iter()
                .map(|b| serde_json::Value::from(*b))
                .collect::<Vec<_>>(),
        ),
        // Generated content is ASCII, so this is lossless.
        PromptFormat::Text | PromptFormat::English => {
            serde_json::Value::from(String::from_utf8_lossy(prompt))
        }
    };
    serde_json::to_vec(&serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": format!("session-{session}"),
    }))
    .unwrap_or_default()
}

#[allow(clippy::too_many_arguments)]
async fn request(
    sh: &Shared,
    session: usize,
    chain: usize,
    turn: usize,
    kind: TurnKind,
    prompt: &[u8],
    max_tokens: u32,
) {
    let units = units(prompt, sh.o.prompt_format.content());
    let reusable_tokens = reusable(sh, &units);
    let body = body(&sh.o.model, prompt, max_tokens, sh.o.prompt_format, session);
    let start_s = sh.start.elapsed().as_secs_f64();
    let now = sh.inflight.fetch_add(1, Ordering::SeqCst) + 1;
    sh.peak_inflight.fetch_max(now, Ordering::SeqCst);
    let r = sh.client.complete(&body).await;
    sh.inflight.fetch_sub(1, Ordering::SeqCst);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let outcome = r.map(|c| Measured {
        ttft_ms: ms(c.ttft),
        itl_ms: c.itl.iter().map(|d| ms(*d)).collect(),
        e2e_ms: ms(c.e2e),
        output_tokens: c.completion_tokens.unwrap_or(c.chunks),
        usage_prompt_tokens: c.prompt_tokens,
        cached_tokens: c.cached_tokens,
    });
    if outcome.is_err() {
        let n = sh.errors.fetch_add(1, Ordering::SeqCst) + 1;
        if n >= sh.o.max_errors {
            sh.abort.store(true, Ordering::SeqCst);
        }
    }
    lock(&sh.records).push(Record {
        session,
        chain,
        turn,
        kind,
        prompt_tokens: units.len(),
        reusable_tokens,
        max_tokens,
        start_s,
        outcome,
    });
    if let Some(b) = &sh.bar {
        b.inc(1);
    }
}
