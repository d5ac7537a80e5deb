//! Claude Code session traces (`../shared/traces/claude-code-sample/*.json`, format in
//! `../shared/traces/README.md`) mapped onto the session model of [`super::workload`].
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
//!   `scale(out)` of its last request to the parent's context;
//! * a request whose prompt + output would pass `--max-context` ends its chain (counted as
//!   truncated).
//!
//! `scale(x) = round(x * token_scale)`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::workload::{BOS_MARGIN, Base, Chain, Rng, Segment, Session, Step, Workload, mix};

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

/// The `*.json` files of a directory, or the file itself, sorted.
pub fn expand(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let rd = std::fs::read_dir(p)
                .map_err(|e| anyhow::anyhow!("cannot list trace directory {}: {e}", p.display()))?;
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            v.sort();
            if v.is_empty() {
                anyhow::bail!("trace directory {} has no *.json file", p.display());
            }
            out.extend(v);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// Loads the traces and maps them onto sessions.
pub fn load(paths: &[PathBuf], p: &TraceParams, seed: u64) -> anyhow::Result<Workload> {
    if !(p.token_scale.is_finite() && p.token_scale > 0.0) {
        anyhow::bail!("--token-scale must be > 0, not {}", p.token_scale);
    }
    let files = expand(paths)?;
    if files.is_empty() {
        anyhow::bail!("no trace file given");
    }
    let mut parsed = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f)
            .map_err(|e| anyhow::anyhow!("cannot read trace {}: {e}", f.display()))?;
        parsed.push(parse(&text, f).map_err(|e| anyhow::anyhow!("{e}"))?);
    }
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

/// A parse error naming the file and the field.
fn err(file: &Path, field: &str, msg: impl std::fmt::Display) -> String {
    format!("{}: {field}: {msg}", file.display())
}

fn parse(text: &str, file: &Path) -> Result<TraceSession, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        format!(
            "{}:{}:{}: not valid JSON: {e}",
            file.display(),
            e.line(),
            e.column()
        )
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| err(file, "(document)", "expected a JSON object"))?;
    let num =
        |o: &serde_json::Map<String, Value>, field: &str, path: &str| -> Result<u64, String> {
            match o.get(field) {
                None => Ok(0),
                Some(x) => x.as_u64().ok_or_else(|| {
                    err(
                        file,
                        &format!("{path}{field}"),
                        format!("expected a non-negative integer, got {x}"),
                    )
                }),
            }
        };
    let secs = |o: &serde_json::Map<String, Value>,
                field: &str,
                path: &str,
                required: bool|
     -> Result<f64, String> {
        match o.get(field) {
            None if !required => Ok(0.0),
            None => Err(err(file, &format!("{path}{field}"), "missing")),
            Some(x) => x
                .as_f64()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| {
                    err(
                        file,
                        &format!("{path}{field}"),
                        format!("expected a number >= 0, got {x}"),
                    )
                }),
        }
    };
    let req = |o: &serde_json::Map<String, Value>, path: &str| -> Result<Req, String> {
        for f in ["in", "out"] {
            if !o.contains_key(f) {
                return Err(err(file, &format!("{path}{f}"), "missing"));
            }
        }
        Ok(Req {
            t: secs(o, "t", path, true)?,
            think_s: secs(o, "think_time", path, false)?,
            input: num(o, "in", path)?,
            output: num(o, "out", path)?,
        })
    };
    let list = |o: &serde_json::Map<String, Value>, path: &str| -> Result<Vec<Value>, String> {
        match o.get("requests") {
            Some(Value::Array(a)) => Ok(a.clone()),
            Some(x) => Err(err(
                file,
                &format!("{path}requests"),
                format!("expected an array, got {}", kind(x)),
            )),
            None => Err(err(file, &format!("{path}requests"), "missing")),
        }
    };
    let harness = num(obj, "system_tokens", "")? + num(obj, "tool_tokens", "")?;
    let mut entries = Vec::new();
    for (i, e) in list(obj, "")?.iter().enumerate() {
        let path = format!("requests[{i}].");
        let o = e
            .as_object()
            .ok_or_else(|| err(file, &format!("requests[{i}]"), "expected an object"))?;
        let ty = o.get("type").and_then(Value::as_str).unwrap_or("n");
        if ty == "subagent" {
            let mut reqs = Vec::new();
            for (j, s) in list(o, &path)?.iter().enumerate() {
                let sp = format!("{path}requests[{j}].");
                let so = s.as_object().ok_or_else(|| {
                    err(file, &format!("{path}requests[{j}]"), "expected an object")
                })?;
                reqs.push(req(so, &sp)?);
            }
            entries.push(Entry::Subagent {
                t: secs(o, "t", &path, true)?,
                duration_s: num(o, "duration_ms", &path)? as f64 / 1000.0,
                harness: num(o, "system_tokens", &path)? + num(o, "tool_tokens", &path)?,
                requests: reqs,
            });
        } else {
            entries.push(Entry::Call(req(o, &path)?));
        }
    }
    if !entries.iter().any(|e| matches!(e, Entry::Call(_))) {
        return Err(err(file, "requests", "no model call (type n or s)"));
    }
    Ok(TraceSession { harness, entries })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
pub(crate) fn parse_for_test(text: &str) -> Result<(), String> {
    parse(text, Path::new("t.json")).map(|_| ())
}
