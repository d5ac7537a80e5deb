//! Readers of block-hash request traces: Mooncake's JSONL (one request a line) and the Claude
//! Code session format (one JSON document a session, subagents nested). See
//! `../shared/traces/README.md` for both formats.
//!
//! Malformed input is an error that names the file and where in it: the line for JSONL, the
//! line and column for a document that is not JSON (a truncated file), the entry's path
//! (`requests[3].requests[0].hash_ids`) for a well-formed document with a bad field. With
//! [`ReadOptions::skip_bad`] a bad line or entry (or a whole session that is not JSON) is
//! skipped and counted instead.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kvtier_server::replay::TraceRequest;
use serde::{Deserialize, Serialize};

/// Tokens per block in the Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// How a trace is read.
#[derive(Clone, Debug, Default)]
pub struct ReadOptions {
    /// Skip (and count) malformed lines and entries instead of failing.
    pub skip_bad: bool,
    /// Read at most this many requests of a Mooncake trace (sessions are never cut).
    pub limit: Option<usize>,
}

/// What was skipped while reading with [`ReadOptions::skip_bad`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct Skipped {
    pub count: u64,
    /// The first few reasons, each naming its place.
    pub first: Vec<String>,
}

impl Skipped {
    const KEEP: usize = 5;

    fn add(&mut self, why: String) {
        self.count += 1;
        if self.first.len() < Self::KEEP {
            self.first.push(why);
        }
    }
}

/// One request of a Mooncake trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeRequest {
    /// Arrival, in milliseconds from the trace start.
    pub timestamp_ms: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// One id per 512-token block of the prompt (the last one may be partial).
    pub hash_ids: Vec<u64>,
}

impl MooncakeRequest {
    /// Whether the prompt's last block is partial.
    pub fn partial_last_block(&self) -> bool {
        !self
            .input_tokens
            .is_multiple_of(u64::from(MOONCAKE_BLOCK_TOKENS))
    }

    /// Blocks a cache stores after the request: all, or all but a partial last one.
    pub fn blocks_to_store(&self, full_blocks_only: bool) -> usize {
        if full_blocks_only && self.partial_last_block() {
            self.hash_ids.len().saturating_sub(1)
        } else {
            self.hash_ids.len()
        }
    }
}

/// A Mooncake trace as read.
#[derive(Clone, Debug)]
pub struct MooncakeTrace {
    pub path: PathBuf,
    pub requests: Vec<MooncakeRequest>,
    pub skipped: Skipped,
}

impl MooncakeTrace {
    /// The requests as the store's simulator wants them.
    pub fn trace_requests(&self, full_blocks_only: bool) -> Vec<TraceRequest> {
        self.requests
            .iter()
            .map(|r| TraceRequest {
                timestamp_ms: r.timestamp_ms,
                block_ids: r.hash_ids.clone(),
                blocks_to_store: r.blocks_to_store(full_blocks_only),
            })
            .collect()
    }
}

/// Reads a Mooncake JSONL trace.
pub fn read_mooncake(path: &Path, opts: &ReadOptions) -> Result<MooncakeTrace> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut requests = Vec::new();
    let mut skipped = Skipped::default();
    let mut last_ts = 0;
    for (n, line) in text.lines().enumerate() {
        if opts.limit.is_some_and(|l| requests.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), n + 1);
        match parse_mooncake_line(line, last_ts) {
            Ok(r) => {
                last_ts = r.timestamp_ms;
                requests.push(r);
            }
            Err(why) if opts.skip_bad => skipped.add(format!("{at}: {why}")),
            Err(why) => bail!("{at}: {why}"),
        }
    }
    if requests.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok(MooncakeTrace {
        path: path.to_owned(),
        requests,
        skipped,
    })
}

#[derive(Deserialize)]
struct RawMooncake {
    timestamp: Option<serde_json::Value>,
    input_length: Option<serde_json::Value>,
    output_length: Option<serde_json::Value>,
    hash_ids: Option<serde_json::Value>,
}

fn uint(v: &Option<serde_json::Value>, field: &str) -> Result<u64, String> {
    match v {
        None => Err(format!("no `{field}`")),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("`{field}` is {v}, not a non-negative integer")),
    }
}

fn ids(v: &Option<serde_json::Value>, field: &str) -> Result<Vec<u64>, String> {
    let arr = match v {
        None => return Err(format!("no `{field}`")),
        Some(v) => v
            .as_array()
            .ok_or_else(|| format!("`{field}` is not an array"))?,
    };
    arr.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .filter(|id| *id <= u64::from(u32::MAX))
                .ok_or_else(|| format!("`{field}[{i}]` is {x}, not an integer below 2^32"))
        })
        .collect()
}

fn parse_mooncake_line(line: &str, last_ts: u64) -> Result<MooncakeRequest, String> {
    let raw: RawMooncake =
        serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
    let timestamp_ms = uint(&raw.timestamp, "timestamp")?;
    let input_tokens = uint(&raw.input_length, "input_length")?;
    let output_tokens = match raw.output_length {
        None => 0,
        ref v => uint(v, "output_length")?,
    };
    let hash_ids = ids(&raw.hash_ids, "hash_ids")?;
    let want = input_tokens.div_ceil(u64::from(MOONCAKE_BLOCK_TOKENS));
    if hash_ids.len() as u64 != want {
        return Err(format!(
            "{} hash_ids for {input_tokens} input tokens (want ceil(input/512) = {want})",
            hash_ids.len()
        ));
    }
    if timestamp_ms < last_ts {
        return Err(format!(
            "timestamp {timestamp_ms} goes back in time (previous {last_ts})"
        ));
    }
    Ok(MooncakeRequest {
        timestamp_ms,
        input_tokens,
        output_tokens,
        hash_ids,
    })
}

/// A recorded coding-agent session (Claude Code format).
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub path: PathBuf,
    pub id: String,
    /// Tokens per block (64 in the public samples).
    pub block_tokens: u32,
    /// The harness prefix every call of the main chain starts with: `system_tokens +
    /// tool_tokens` (0 where absent).
    pub harness_tokens: u64,
    /// The main chain; subagents are nested in it.
    pub chain: Chain,
}

impl Session {
    /// Model calls in the session, subagents included.
    pub fn calls(&self) -> usize {
        self.chain.calls()
    }
}

/// Model calls that run one after another, and subagents started from among them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chain {
    pub items: Vec<ChainItem>,
}

impl Chain {
    pub fn calls(&self) -> usize {
        self.items
            .iter()
            .map(|i| match i {
                ChainItem::Call(_) => 1,
                ChainItem::Subagent(s) => s.chain.calls(),
            })
            .sum()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ChainItem {
    Call(ModelCall),
    Subagent(Subagent),
}

/// One model call of a chain.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCall {
    /// Start in the recording, seconds from the chain's start.
    pub t_s: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// One id per full block of the prompt, local to the session.
    pub hash_ids: Vec<u64>,
    /// How long the model took in the recording, when known.
    pub api_time_s: Option<f64>,
    /// The gap between the previous call of the chain finishing and this one starting.
    pub think_time_s: f64,
}

/// A subagent: its own chain, started at `t_s` in its parent's recording.
#[derive(Clone, Debug, PartialEq)]
pub struct Subagent {
    pub t_s: f64,
    pub agent_id: String,
    /// How long it ran in the recording (`duration_ms`; 0 where absent).
    pub duration_s: f64,
    /// Its own harness prefix: `system_tokens + tool_tokens` (0 where absent).
    pub harness_tokens: u64,
    pub chain: Chain,
}

#[derive(Deserialize)]
struct RawSession {
    id: Option<String>,
    block_size: Option<serde_json::Value>,
    hash_id_scope: Option<String>,
    system_tokens: Option<u64>,
    tool_tokens: Option<u64>,
    requests: Option<Vec<serde_json::Value>>,
}

#[derive(Deserialize)]
struct RawEntry {
    t: Option<f64>,
    #[serde(rename = "type")]
    kind: Option<String>,
    #[serde(rename = "in")]
    input: Option<u64>,
    out: Option<u64>,
    hash_ids: Option<Vec<u64>>,
    api_time: Option<f64>,
    think_time: Option<f64>,
    agent_id: Option<String>,
    duration_ms: Option<u64>,
    system_tokens: Option<u64>,
    tool_tokens: Option<u64>,
    requests: Option<Vec<serde_json::Value>>,
}

/// Reads one Claude Code session document. With `skip_bad`, a document that is not JSON
/// yields `Ok(None)` (counted in `skipped`), and bad entries are left out and counted.
pub fn read_session(
    path: &Path,
    opts: &ReadOptions,
    skipped: &mut Skipped,
) -> Result<Option<Session>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file = path.display().to_string();
    let raw: RawSession = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            let why = format!(
                "{file}:{}:{}: not a session document: {e}",
                e.line(),
                e.column()
            );
            if opts.skip_bad {
                skipped.add(why);
                return Ok(None);
            }
            bail!(why);
        }
    };
    let block_tokens = match &raw.block_size {
        None => bail!("{file}: no `block_size`"),
        Some(v) => v
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .filter(|b| b.is_power_of_two() && *b <= 512)
            .with_context(|| {
                format!("{file}: `block_size` is {v}, not a power of two from 1 to 512")
            })?,
    };
    if let Some(scope) = &raw.hash_id_scope
        && scope != "local"
    {
        bail!("{file}: `hash_id_scope` is {scope:?}; only \"local\" is known");
    }
    let Some(entries) = raw.requests else {
        bail!("{file}: no `requests` list");
    };
    let chain = read_chain(&file, "requests", &entries, block_tokens, opts, skipped)?;
    if chain.calls() == 0 {
        bail!("{file}: no model calls");
    }
    Ok(Some(Session {
        path: path.to_owned(),
        id: raw.id.unwrap_or_else(|| file.clone()),
        block_tokens,
        harness_tokens: harness(raw.system_tokens, raw.tool_tokens),
        chain,
    }))
}

fn read_chain(
    file: &str,
    at: &str,
    entries: &[serde_json::Value],
    block_tokens: u32,
    opts: &ReadOptions,
    skipped: &mut Skipped,
) -> Result<Chain> {
    let mut items = Vec::with_capacity(entries.len());
    let mut last_t = f64::NEG_INFINITY;
    for (i, v) in entries.iter().enumerate() {
        let here = format!("{at}[{i}]");
        match read_entry(file, &here, v, block_tokens, last_t, opts, skipped) {
            Ok(item) => {
                last_t = match &item {
                    ChainItem::Call(c) => c.t_s,
                    ChainItem::Subagent(s) => s.t_s,
                };
                items.push(item);
            }
            Err(why) => {
                // A nested entry's error already names its full path.
                let at = if why.starts_with(&format!("{here}.")) {
                    format!("{file}: {why}")
                } else {
                    format!("{file}: {here}: {why}")
                };
                if opts.skip_bad {
                    skipped.add(at);
                } else {
                    bail!(at);
                }
            }
        }
    }
    Ok(Chain { items })
}

/// `system_tokens + tool_tokens`, each 0 where absent.
fn harness(system: Option<u64>, tools: Option<u64>) -> u64 {
    system.unwrap_or(0).saturating_add(tools.unwrap_or(0))
}

fn finite_nonneg(v: Option<f64>, field: &str) -> Result<f64, String> {
    match v {
        None => Err(format!("no `{field}`")),
        Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
        Some(x) => Err(format!("`{field}` is {x}, not a non-negative number")),
    }
}

fn read_entry(
    file: &str,
    here: &str,
    v: &serde_json::Value,
    block_tokens: u32,
    last_t: f64,
    opts: &ReadOptions,
    skipped: &mut Skipped,
) -> Result<ChainItem, String> {
    let e: RawEntry = RawEntry::deserialize(v).map_err(|e| e.to_string())?;
    let t_s = finite_nonneg(e.t, "t")?;
    if t_s < last_t {
        return Err(format!("`t` {t_s} goes back in time (previous {last_t})"));
    }
    match e.kind.as_deref() {
        Some("subagent") => {
            let Some(sub) = e.requests else {
                return Err("subagent without a `requests` list".into());
            };
            let chain = read_chain(
                file,
                &format!("{here}.requests"),
                &sub,
                block_tokens,
                opts,
                skipped,
            )
            .map_err(|e| {
                // The nested error already names the file; keep only its own text.
                let s = format!("{e:#}");
                s.strip_prefix(&format!("{file}: "))
                    .unwrap_or(&s)
                    .to_owned()
            })?;
            Ok(ChainItem::Subagent(Subagent {
                t_s,
                agent_id: e.agent_id.unwrap_or_default(),
                duration_s: e.duration_ms.unwrap_or(0) as f64 / 1000.0,
                harness_tokens: harness(e.system_tokens, e.tool_tokens),
                chain,
            }))
        }
        Some(_) => {
            let input_tokens = e.input.ok_or("no `in`")?;
            let hash_ids = e.hash_ids.ok_or("no `hash_ids`")?;
            if let Some(big) = hash_ids.iter().find(|id| **id > u64::from(u32::MAX)) {
                return Err(format!("hash id {big} is not below 2^32"));
            }
            let (lo, hi) = (
                input_tokens / u64::from(block_tokens),
                input_tokens.div_ceil(u64::from(block_tokens)),
            );
            let n = hash_ids.len() as u64;
            if n < lo || n > hi {
                return Err(format!(
                    "{n} hash_ids for {input_tokens} input tokens of {block_tokens}-token blocks \
                     (want {lo}{})",
                    if hi > lo {
                        format!(" or {hi}")
                    } else {
                        String::new()
                    }
                ));
            }
            let api_time_s = match e.api_time {
                None => None,
                Some(_) => Some(finite_nonneg(e.api_time, "api_time")?),
            };
            Ok(ChainItem::Call(ModelCall {
                t_s,
                input_tokens,
                output_tokens: e.out.unwrap_or(0),
                hash_ids,
                api_time_s,
                think_time_s: match e.think_time {
                    None => 0.0,
                    Some(_) => finite_nonneg(e.think_time, "think_time")?,
                },
            }))
        }
        None => Err("no `type`".into()),
    }
}

/// Claude Code sessions from files and directories (every `*.json` in a directory, sorted).
pub fn read_sessions(paths: &[PathBuf], opts: &ReadOptions) -> Result<(Vec<Session>, Skipped)> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("reading directory {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.extension().is_some_and(|x| x == "json"))
                .collect();
            found.sort();
            if found.is_empty() {
                bail!("{}: no *.json session files", p.display());
            }
            files.extend(found);
        } else {
            files.push(p.clone());
        }
    }
    let mut skipped = Skipped::default();
    let mut sessions = Vec::new();
    for f in &files {
        if let Some(s) = read_session(f, opts, &mut skipped)? {
            sessions.push(s);
        }
    }
    if sessions.is_empty() {
        bail!("no readable sessions in {}", display_paths(paths));
    }
    let bt = sessions[0].block_tokens;
    if let Some(other) = sessions.iter().find(|s| s.block_tokens != bt) {
        bail!(
            "{} has {}-token blocks but {} has {bt}: one replay uses one block size",
            other.path.display(),
            other.block_tokens,
            sessions[0].path.display()
        );
    }
    Ok((sessions, skipped))
}

pub fn display_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shared traces directory (`../shared/traces` next to the repository).
pub fn shared_traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const GOOD: &str =
        "{\"timestamp\":0,\"input_length\":600,\"output_length\":3,\"hash_ids\":[1,2]}";

    #[test]
    fn mooncake_bad_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let check = |body: &str, want: &[&str]| {
            let p = write(dir.path(), "t.jsonl", body);
            let e = format!(
                "{:#}",
                read_mooncake(&p, &ReadOptions::default()).unwrap_err()
            );
            for w in want {
                assert!(e.contains(w), "{e:?} lacks {w:?}");
            }
        };
        check(
            &format!("{GOOD}\n{{\"timestamp\":1,\"input_length\":5}}\n"),
            &["t.jsonl:2", "hash_ids"],
        );
        check(
            "{\"timestamp\":0,\"input_length\":600,\"hash_ids\":[1]}\n",
            &["t.jsonl:1", "ceil"],
        );
        // Truncated last line.
        check(
            &format!("{GOOD}\n{{\"timestamp\":1,\"input_len"),
            &["t.jsonl:2", "not a JSON object"],
        );
        check(
            "{\"timestamp\":5,\"input_length\":1,\"hash_ids\":[1]}\n{\"timestamp\":4,\"input_length\":1,\"hash_ids\":[1]}\n",
            &["t.jsonl:2", "back in time"],
        );
        check(
            "{\"timestamp\":-1,\"input_length\":1,\"hash_ids\":[1]}\n",
            &["t.jsonl:1", "timestamp"],
        );
        check(
            "{\"timestamp\":1,\"input_length\":1,\"hash_ids\":[\"a\"]}\n",
            &["t.jsonl:1", "hash_ids[0]"],
        );
        check("\n\n", &["no requests"]);
    }

    #[test]
    fn mooncake_skip_bad_counts_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "t.jsonl",
            &format!(
                "{GOOD}\nnot json\n{GOOD}\n{{\"timestamp\":9,\"input_length\":1}}\n{GOOD}\n{{\"times"
            ),
        );
        let opts = ReadOptions {
            skip_bad: true,
            limit: None,
        };
        let t = read_mooncake(&p, &opts).unwrap();
        assert_eq!(t.requests.len(), 3);
        assert_eq!(t.skipped.count, 3);
        assert!(t.skipped.first[0].contains("t.jsonl:2"), "{:?}", t.skipped);
        assert!(t.skipped.first[2].contains("t.jsonl:6"), "{:?}", t.skipped);
        assert_eq!(
            t.requests[0],
            MooncakeRequest {
                timestamp_ms: 0,
                input_tokens: 600,
                output_tokens: 3,
                hash_ids: vec![1, 2]
            }
        );
        assert_eq!(t.requests[0].blocks_to_store(true), 1);
        assert_eq!(t.requests[0].blocks_to_store(false), 2);
        let opts = ReadOptions {
            skip_bad: false,
            limit: Some(1),
        };
        assert_eq!(read_mooncake(&p, &opts).unwrap().requests.len(), 1);
    }

    const SESSION: &str = r#"{"id": "s1", "block_size": 64, "hash_id_scope": "local",
 "requests": [
  {"t": 0.0, "type": "n", "in": 130, "out": 10, "hash_ids": [0, 1], "api_time": 2.0, "think_time": 0.0},
  {"t": 5.0, "type": "subagent", "agent_id": "a1", "requests": [
     {"t": 0.0, "type": "n", "in": 64, "out": 5, "hash_ids": [7], "think_time": 0.0}
  ]},
  {"t": 6.0, "type": "s", "in": 200, "out": 10, "hash_ids": [0, 1, 2], "api_time": 1.0, "think_time": 4.0}
 ]}"#;

    #[test]
    fn sessions_parse_with_subagents() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "s.json", SESSION);
        let (s, skipped) =
            read_sessions(&[dir.path().to_owned()], &ReadOptions::default()).unwrap();
        assert_eq!(skipped.count, 0);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].path, p);
        assert_eq!(s[0].block_tokens, 64);
        assert_eq!(s[0].calls(), 3);
        let ChainItem::Subagent(sub) = &s[0].chain.items[1] else {
            panic!("{:?}", s[0].chain.items[1]);
        };
        assert_eq!(sub.agent_id, "a1");
        assert_eq!(sub.chain.calls(), 1);
        let ChainItem::Call(c) = &s[0].chain.items[2] else {
            panic!()
        };
        assert_eq!((c.think_time_s, c.api_time_s), (4.0, Some(1.0)));
    }

    #[test]
    fn bad_sessions_name_file_and_place() {
        let dir = tempfile::tempdir().unwrap();
        let check = |body: &str, want: &[&str]| {
            let p = write(dir.path(), "s.json", body);
            let mut sk = Skipped::default();
            let e = format!(
                "{:#}",
                read_session(&p, &ReadOptions::default(), &mut sk).unwrap_err()
            );
            for w in want {
                assert!(e.contains(w), "{e:?} lacks {w:?}");
            }
        };
        // Truncated: line and column.
        let line = SESSION[..200].lines().count();
        check(
            &SESSION[..200],
            &[&format!("s.json:{line}:"), "not a session document"],
        );
        check(
            &SESSION.replace("\"hash_ids\": [0, 1, 2]", "\"hash_ids\": [0]"),
            &["s.json", "requests[2]", "1 hash_ids for 200"],
        );
        check(
            &SESSION.replace("\"hash_ids\": [7]", "\"hash_ids\": \"x\""),
            &["s.json: requests[1].requests[0]: invalid type"],
        );
        check(
            &SESSION.replace("\"t\": 6.0", "\"t\": 1.0"),
            &["requests[2]", "back in time"],
        );
        check(
            &SESSION.replace("\"block_size\": 64", "\"block_size\": 60"),
            &["s.json", "block_size"],
        );
        check(
            &SESSION.replace("\"think_time\": 4.0", "\"think_time\": -4.0"),
            &["requests[2]", "think_time"],
        );
    }

    #[test]
    fn session_skip_bad_counts_entries_and_truncated_files() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "a.json",
            &SESSION.replace("\"hash_ids\": [7]", "\"hash_ids\": \"x\""),
        );
        write(dir.path(), "b.json", &SESSION[..150]);
        let opts = ReadOptions {
            skip_bad: true,
            limit: None,
        };
        let (s, skipped) = read_sessions(&[dir.path().to_owned()], &opts).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].calls(), 2);
        assert_eq!(skipped.count, 2, "{skipped:?}");
        assert!(
            skipped
                .first
                .iter()
                .any(|w| w.contains("a.json: requests[1].requests[0]"))
        );
        assert!(skipped.first.iter().any(|w| w.contains("b.json:")));
    }

    #[test]
    fn the_shared_samples_parse() {
        let dir = shared_traces_dir().join("claude-code-sample");
        let (s, skipped) = read_sessions(&[dir], &ReadOptions::default()).unwrap();
        assert_eq!(skipped.count, 0);
        assert_eq!(s.len(), 6);
        assert!(s.iter().all(|s| s.block_tokens == 64));
        let subagents: usize = s
            .iter()
            .map(|s| {
                s.chain
                    .items
                    .iter()
                    .filter(|i| matches!(i, ChainItem::Subagent(_)))
                    .count()
            })
            .sum();
        assert!(subagents >= 1);
    }
}
