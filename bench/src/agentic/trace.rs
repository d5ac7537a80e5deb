//! Claude Code session traces (`../shared/traces/claude-code-sample/*.json`, format in
//! `../shared/traces/README.md`), read by the workspace's one reader ([`crate::trace`]), mapped
//! onto the session model of [`super::workload`].
//!
//! Mapping, per trace file (one session; more sessions than files reuse the files in order with
//! other content seeds):
//! * harness: the first `scale(system_tokens + tool_tokens)` tokens of the shared harness prefix;
//! * main-chain request i: wait `think_time`, append `max(scale(in) - context, 1)` new tokens
//!   (the previous output and the tool results), ask for `clamp(scale(out), 1, max_output)`;
//! * a `subagent` entry: spawned at its position in the main chain with its own harness
//!   (`scale(system_tokens + tool_tokens)` of the subagent, sharing the common harness stream),
//!   its nested requests mapped the same way; it rejoins before the first main request whose `t`
//!   is at or after the subagent's end (`t + duration_ms`), or at the end of the session, adding
//!   `scale(out)` of its last request to the parent's context (a subagent's own subagents are
//!   not modelled: their calls are left out);
//! * a request whose prompt + output would pass `--max-context` ends its chain (counted as
//!   truncated).
//!
//! `scale(x) = round(x * token_scale)`.

use std::path::PathBuf;

use super::workload::{BOS_MARGIN, Base, Chain, Rng, Segment, Session, Step, Workload, mix};
use crate::trace::{self as reader, ChainItem, ModelCall, ReadOptions};

#[derive(Clone, Debug)]
pub struct TraceParams {
    pub token_scale: f64,
    pub max_context: usize,
    pub max_output: usize,
    pub long_idle_s: f64,
    pub sessions: Option<usize>,
}

/// One model call of a trace.
#[derive(Clone, Debug, PartialEq)]
struct Req {
    t: f64,
    think_s: f64,
    input: u64,
    output: u64,
}

#[derive(Clone, Debug, PartialEq)]
enum Entry {
    Call(Req),
    Subagent {
        t: f64,
        duration_s: f64,
        harness: u64,
        requests: Vec<Req>,
    },
}

#[derive(Clone, Debug, PartialEq)]
struct TraceSession {
    harness: u64,
    entries: Vec<Entry>,
}

/// Loads the traces and maps them onto sessions.
pub fn load(paths: &[PathBuf], p: &TraceParams, seed: u64) -> anyhow::Result<Workload> {
    if !(p.token_scale.is_finite() && p.token_scale > 0.0) {
        anyhow::bail!("--token-scale must be > 0, not {}", p.token_scale);
    }
    // Strict: a malformed session is an error naming its file and place, never skipped.
    let (sessions, _) = reader::read_sessions(paths, &ReadOptions::default())?;
    let files: Vec<PathBuf> = sessions.iter().map(|s| s.path.clone()).collect();
    let parsed: Vec<TraceSession> = sessions.iter().map(from_session).collect();
    let n = p.sessions.unwrap_or(parsed.len());
    let mut truncated = 0;
    let sessions = (0..n)
        .map(|id| {
            let t = &parsed[id % parsed.len()];
            let mut r = Rng::new(mix(seed, 0xc1a0_0000 + id as u64));
            Session {
                id,
                main: map_session(t, p, &mut r, &mut truncated),
            }
        })
        .collect();
    Ok(Workload {
        source: {
            let name = |f: &PathBuf| {
                f.file_name().map_or_else(
                    || f.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                )
            };
            match (files.first(), files.last()) {
                (Some(a), Some(b)) if files.len() > 1 => format!(
                    "claude-code trace: {} .. {} ({} files)",
                    name(a),
                    name(b),
                    files.len()
                ),
                _ => format!("claude-code trace: {}", files[0].display()),
            }
        },
        harness_seed: mix(seed, 0x4a52_4e45_5353),
        sessions,
        long_idle_s: p.long_idle_s,
        truncated_turns: truncated,
    })
}

fn scale(x: u64, p: &TraceParams) -> usize {
    (x as f64 * p.token_scale).round() as usize
}

fn map_session(t: &TraceSession, p: &TraceParams, r: &mut Rng, truncated: &mut usize) -> Chain {
    let harness = scale(t.harness, p).min(p.max_context / 2);
    let mut steps = Vec::new();
    let mut ctx = harness;
    // Subagents waiting to rejoin: (end time, result tokens).
    let mut pending: Vec<(f64, usize)> = Vec::new();
    let mut ended = false;
    let mut remaining_calls = t
        .entries
        .iter()
        .filter(|e| matches!(e, Entry::Call(_)))
        .count();
    for e in &t.entries {
        match e {
            Entry::Call(q) => {
                remaining_calls -= 1;
                if ended {
                    continue;
                }
                if !pending.is_empty() && pending.iter().all(|(end, _)| q.t >= *end) {
                    let add: usize = pending.drain(..).map(|(_, n)| n).sum();
                    steps.push(Step::Join {
                        append: r.segment(add),
                    });
                    ctx += add;
                }
                match turn(q, p, r, ctx, true) {
                    Some((step, new_ctx)) => {
                        steps.push(step);
                        ctx = new_ctx;
                    }
                    None => {
                        *truncated += 1 + remaining_calls;
                        ended = true;
                    }
                }
            }
            Entry::Subagent {
                t: start,
                duration_s,
                harness: sub_h,
                requests,
            } => {
                if ended {
                    *truncated += requests.len();
                    continue;
                }
                let h = scale(*sub_h, p).min(p.max_context / 2);
                let mut sub_ctx = h;
                let mut sub_steps = Vec::new();
                for (i, q) in requests.iter().enumerate() {
                    match turn(q, p, r, sub_ctx, i > 0) {
                        Some((step, c)) => {
                            sub_steps.push(step);
                            sub_ctx = c;
                        }
                        None => {
                            *truncated += requests.len() - i;
                            break;
                        }
                    }
                }
                if !sub_steps.is_empty() {
                    let result = requests
                        .last()
                        .map_or(1, |q| scale(q.output, p).clamp(1, p.max_output));
                    pending.push((start + duration_s, result));
                    steps.push(Step::Spawn(vec![Chain {
                        base: Base::Harness(h),
                        steps: sub_steps,
                    }]));
                }
            }
        }
    }
    if !pending.is_empty() {
        let add: usize = if ended {
            0
        } else {
            pending.iter().map(|(_, n)| n).sum()
        };
        steps.push(Step::Join {
            append: r.segment(add),
        });
    }
    Chain {
        base: Base::Harness(harness),
        steps,
    }
}

fn turn(q: &Req, p: &TraceParams, r: &mut Rng, ctx: usize, gap: bool) -> Option<(Step, usize)> {
    let target = scale(q.input, p);
    let append = target.saturating_sub(ctx).max(1);
    let out = scale(q.output, p).clamp(1, p.max_output);
    if ctx + append + out + BOS_MARGIN > p.max_context {
        return None;
    }
    Some((
        Step::Turn {
            gap_s: if gap { q.think_s } else { 0.0 },
            append: Segment {
                seed: r.u64(),
                len: append,
            },
            max_tokens: out as u32,
        },
        ctx + append,
    ))
}

/// The parts of a session the mapping uses.
fn from_session(s: &reader::Session) -> TraceSession {
    let req = |c: &ModelCall| Req {
        t: c.t_s,
        think_s: c.think_time_s,
        input: c.input_tokens,
        output: c.output_tokens,
    };
    let entries = s
        .chain
        .items
        .iter()
        .map(|item| match item {
            ChainItem::Call(c) => Entry::Call(req(c)),
            ChainItem::Subagent(a) => Entry::Subagent {
                t: a.t_s,
                duration_s: a.duration_s,
                harness: a.harness_tokens,
                requests: a
                    .chain
                    .items
                    .iter()
                    .filter_map(|i| match i {
                        ChainItem::Call(c) => Some(req(c)),
                        ChainItem::Subagent(_) => None,
                    })
                    .collect(),
            },
        })
        .collect();
    TraceSession {
        harness: s.harness_tokens,
        entries,
    }
}
