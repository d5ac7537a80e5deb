//! `kvtier-bench policy`: eviction policies replayed through the real store on block-hash
//! traces (Mooncake JSONL), against plain LRU and an offline optimum computed on the same
//! trace, at several capacities.

use std::collections::{BinaryHeap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use kvtier_server::policy::{ChainAwareTuning, EvictionKind, Horizon};
use kvtier_server::replay::{TraceRequest, replay, replay_tuned};
use serde::Serialize;

use crate::report::{Plot, PlotKind, Report, Table};
use crate::trace::{self, ReadOptions};

/// Tokens per block in the Mooncake traces.
const TRACE_BLOCK_TOKENS: u64 = trace::MOONCAKE_BLOCK_TOKENS as u64;

#[derive(Args, Debug)]
pub struct PolicyArgs {
    /// Mooncake-format JSONL traces (`hash_ids` of 512-token blocks). Default: the
    /// conversation and synthetic traces in ../shared/traces.
    #[arg(long = "trace")]
    pub traces: Vec<PathBuf>,
    /// Cache capacities in tokens (decimal units: 1m = 1,000,000).
    #[arg(long, value_delimiter = ',', default_value = "1m,3m,10m,50m", value_parser = parse_tokens)]
    pub capacities: Vec<u64>,
    /// Store only full blocks (the partial last block of a prompt is not cached), as a real
    /// engine does. Default: store every block, the convention of the traces' published LRU
    /// figures.
    #[arg(long)]
    pub full_blocks_only: bool,
    /// Replay only the first N requests of each trace.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Also replay the default policy with these protection horizons (ticks a slot, or
    /// `ladder`: chosen online among `LADDER`, the default's), crossed with
    /// `--protect-margin`: a parameter study.
    #[arg(long, value_delimiter = ',', value_parser = parse_horizon)]
    pub horizon_slots: Vec<Horizon>,
    /// ... and these leads of the duel's protecting shadows (0.05 = 5 %; the default's is
    /// `PROTECT_MARGIN`). Either list alone is crossed with the other's default.
    #[arg(long, value_delimiter = ',', value_parser = parse_margin)]
    pub protect_margin: Vec<f64>,
    /// ... and with the duel's bimodal-admission shadow `on` (the default) or `off`.
    #[arg(long, value_delimiter = ',', value_parser = parse_on_off)]
    pub bimodal: Vec<bool>,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.trim() {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?} is not on or off")),
    }
}

fn parse_horizon(s: &str) -> Result<Horizon, String> {
    if s.trim() == "ladder" {
        return Ok(Horizon::Ladder);
    }
    match s.trim().parse::<u64>() {
        Ok(h @ 1..=1024) => Ok(Horizon::Fixed(h)),
        _ => Err(format!(
            "{s:?} is not a horizon in ticks a slot (1 to 1024, or ladder)"
        )),
    }
}

fn parse_margin(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(m) if (0.0..=10.0).contains(&m) => Ok(m),
        _ => Err(format!(
            "{s:?} is not a margin (a share from 0 to 10, e.g. 0.05)"
        )),
    }
}

impl PolicyArgs {
    /// The parameter pairs of the study, empty without one.
    fn grid(&self) -> Vec<ChainAwareTuning> {
        if self.horizon_slots.is_empty()
            && self.protect_margin.is_empty()
            && self.bimodal.is_empty()
        {
            return Vec::new();
        }
        let d = ChainAwareTuning::default();
        let hs = if self.horizon_slots.is_empty() {
            vec![d.horizon]
        } else {
            self.horizon_slots.clone()
        };
        let ms = if self.protect_margin.is_empty() {
            vec![d.protect_margin]
        } else {
            self.protect_margin.clone()
        };
        let bs = if self.bimodal.is_empty() {
            vec![d.bimodal]
        } else {
            self.bimodal.clone()
        };
        let mut grid = Vec::new();
        for &horizon in &hs {
            for &protect_margin in &ms {
                for &bimodal in &bs {
                    grid.push(ChainAwareTuning {
                        horizon,
                        protect_margin,
                        bimodal,
                    });
                }
            }
        }
        grid
    }
}

/// Parses a token count in decimal units: `3m` is 3,000,000, `500k` 500,000.
pub fn token_count(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = match t.strip_suffix('m') {
        Some(n) => (n, 1_000_000),
        None => match t.strip_suffix('k') {
            Some(n) => (n, 1_000),
            None => (t.as_str(), 1),
        },
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a token count (e.g. 3m, 500k, 1000000)"))
}

pub fn parse_tokens(s: &str) -> Result<u64, String> {
    match token_count(s)? {
        v if v >= TRACE_BLOCK_TOKENS => Ok(v),
        _ => Err(format!("{s:?} must be at least one 512-token block")),
    }
}

#[derive(Serialize)]
pub struct PolicyReport {
    pub rule: &'static str,
    pub traces: Vec<TraceResult>,
}

#[derive(Serialize)]
pub struct TraceResult {
    pub trace: String,
    pub requests: usize,
    pub blocks: u64,
    pub unlimited_hit_rate: f64,
    pub rows: Vec<CapacityRow>,
}

#[derive(Serialize)]
pub struct CapacityRow {
    pub capacity_tokens: u64,
    pub capacity_blocks: u64,
    pub lru_hit_rate: f64,
    pub default_hit_rate: f64,
    pub optimum_hit_rate: f64,
    /// Share of the LRU-to-optimum gap the default closes.
    pub gap_closed: f64,
    pub default_seconds: f64,
    /// The parameter study's replays (`--horizon-slots`, `--protect-margin`), if asked.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tuned: Vec<TunedRow>,
}

/// The default policy with other parameters, at one capacity.
#[derive(Serialize)]
pub struct TunedRow {
    /// Ticks a slot, or `ladder`.
    pub horizon_slots: String,
    pub protect_margin: f64,
    /// Whether the duel had its bimodal-admission shadow.
    pub bimodal: bool,
    pub hit_rate: f64,
    pub gap_closed: f64,
}

fn gap_closed(hit: f64, lru: f64, opt: f64) -> f64 {
    let gap = opt - lru;
    if gap > 1e-12 { (hit - lru) / gap } else { 0.0 }
}

/// The request's hit count: its longest prefix of ids for which `cached` holds.
fn leading_hits(r: &TraceRequest, cached: impl Fn(&u64) -> bool) -> u64 {
    r.block_ids.iter().take_while(|id| cached(id)).count() as u64
}

/// Hit rate with unlimited capacity: a block hits when its whole prefix was seen before.
pub fn unlimited(trace: &[TraceRequest]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for r in trace {
        hits += leading_hits(r, |id| seen.contains(id));
        total += r.block_ids.len() as u64;
        seen.extend(r.block_ids.iter().take(r.blocks_to_store).copied());
    }
    hits as f64 / total as f64
}

/// The offline optimum (Belady): on overflow, evict the block whose next use is farthest in
/// the future (ties: the deepest, i.e. the largest id). A request's blocks are all inserted
/// before evicting, so a block never used again can be dropped at once.
pub fn optimum(trace: &[TraceRequest], capacity: u64) -> f64 {
    const NEVER: u64 = u64::MAX;
    // next_use[r][i]: the index of the next request containing trace[r].block_ids[i].
    let mut next_use: Vec<Vec<u64>> = Vec::with_capacity(trace.len());
    let mut last: HashMap<u64, u64> = HashMap::new();
    for (r, req) in trace.iter().enumerate().rev() {
        next_use.push(
            req.block_ids
                .iter()
                .map(|id| *last.get(id).unwrap_or(&NEVER))
                .collect(),
        );
        for id in &req.block_ids {
            last.insert(*id, r as u64);
        }
    }
    next_use.reverse();
    let mut cached: HashMap<u64, u64> = HashMap::new();
    let mut heap: BinaryHeap<(u64, u64)> = BinaryHeap::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for (r, req) in trace.iter().enumerate() {
        hits += leading_hits(req, |id| cached.contains_key(id));
        total += req.block_ids.len() as u64;
        for (i, id) in req.block_ids.iter().enumerate().take(req.blocks_to_store) {
            let nu = next_use[r][i];
            cached.insert(*id, nu);
            heap.push((nu, *id));
        }
        while cached.len() as u64 > capacity {
            let Some((nu, id)) = heap.pop() else { break };
            if cached.get(&id) == Some(&nu) {
                cached.remove(&id);
            }
        }
    }
    hits as f64 / total as f64
}

fn default_traces() -> Vec<PathBuf> {
    let shared = trace::shared_traces_dir();
    ["conversation_trace.jsonl", "synthetic_trace.jsonl"]
        .iter()
        .map(|f| shared.join(f))
        .collect()
}

pub fn run(args: &PolicyArgs) -> Result<PolicyReport> {
    let traces = if args.traces.is_empty() {
        default_traces()
    } else {
        args.traces.clone()
    };
    let grid = args.grid();
    let mut out = Vec::new();
    let pb = crate::report::bar(
        (traces.len() * args.capacities.len()) as u64,
        "policy replays",
    );
    for path in &traces {
        let opts = ReadOptions {
            skip_bad: false,
            limit: args.limit,
        };
        let trace = trace::read_mooncake(path, &opts)?.trace_requests(args.full_blocks_only);
        let blocks = trace.iter().map(|r| r.block_ids.len() as u64).sum();
        let mut rows = Vec::new();
        for &tokens in &args.capacities {
            let cap = tokens / TRACE_BLOCK_TOKENS;
            pb.set_message(format!(
                "{} @ {}",
                path.file_name().unwrap_or_default().to_string_lossy(),
                tokens
            ));
            let lru = replay(&trace, cap, EvictionKind::Lru)?.hit_rate();
            let started = Instant::now();
            let def = replay(&trace, cap, EvictionKind::default())?.hit_rate();
            let default_seconds = started.elapsed().as_secs_f64();
            let opt = optimum(&trace, cap);
            let mut tuned = Vec::with_capacity(grid.len());
            for &t in &grid {
                let hit = replay_tuned(&trace, cap, EvictionKind::ChainAware, t)?.hit_rate();
                tuned.push(TunedRow {
                    horizon_slots: t.horizon.to_string(),
                    protect_margin: t.protect_margin,
                    bimodal: t.bimodal,
                    hit_rate: hit,
                    gap_closed: gap_closed(hit, lru, opt),
                });
            }
            rows.push(CapacityRow {
                capacity_tokens: tokens,
                capacity_blocks: cap,
                lru_hit_rate: lru,
                default_hit_rate: def,
                optimum_hit_rate: opt,
                gap_closed: gap_closed(def, lru, opt),
                default_seconds,
                tuned,
            });
            pb.inc(1);
        }
        out.push(TraceResult {
            trace: path.file_name().map_or_else(
                || path.display().to_string(),
                |f| f.to_string_lossy().into_owned(),
            ),
            requests: trace.len(),
            blocks,
            unlimited_hit_rate: unlimited(&trace),
            rows,
        });
    }
    pb.finish_and_clear();
    Ok(PolicyReport {
        rule: if args.full_blocks_only {
            "full blocks only"
        } else {
            "every block (published convention)"
        },
        traces: out,
    })
}

impl Report for PolicyReport {
    fn tables(&self) -> Vec<Table> {
        let mut tables: Vec<Table> = self
            .traces
            .iter()
            .map(|t| {
                let mut table = Table::new(
                    format!(
                        "{} ({} requests, {} blocks; blocks stored: {}; unlimited capacity hit rate {:.2} %)",
                        t.trace,
                        t.requests,
                        t.blocks,
                        self.rule,
                        t.unlimited_hit_rate * 100.0
                    ),
                    &[
                        "capacity (tokens)",
                        "blocks",
                        "lru %",
                        "default %",
                        "optimum %",
                        "gap closed %",
                        "default s",
                    ],
                );
                for row in &t.rows {
                    table.row([
                        row.capacity_tokens.to_string(),
                        row.capacity_blocks.to_string(),
                        format!("{:.2}", row.lru_hit_rate * 100.0),
                        format!("{:.2}", row.default_hit_rate * 100.0),
                        format!("{:.2}", row.optimum_hit_rate * 100.0),
                        format!("{:.1}", row.gap_closed * 100.0),
                        format!("{:.2}", row.default_seconds),
                    ]);
                }
                table
            })
            .collect();
        for t in &self.traces {
            if t.rows.iter().all(|r| r.tuned.is_empty()) {
                continue;
            }
            let mut table = Table::new(
                format!("{}: the default policy with other parameters", t.trace),
                &[
                    "capacity (tokens)",
                    "horizon (ticks a slot)",
                    "margin",
                    "bimodal",
                    "hit %",
                    "- lru (points)",
                    "gap closed %",
                ],
            );
            for row in &t.rows {
                for c in &row.tuned {
                    table.row([
                        row.capacity_tokens.to_string(),
                        c.horizon_slots.clone(),
                        format!("{:.3}", c.protect_margin),
                        if c.bimodal { "on" } else { "off" }.to_string(),
                        format!("{:.2}", c.hit_rate * 100.0),
                        format!("{:+.2}", (c.hit_rate - row.lru_hit_rate) * 100.0),
                        format!("{:.1}", c.gap_closed * 100.0),
                    ]);
                }
            }
            tables.push(table);
        }
        tables
    }

    fn plots(&self) -> Vec<Plot> {
        self.traces
            .iter()
            .map(|t| Plot {
                file: format!("policy-{}", t.trace),
                title: format!("{}: hit rate by capacity", t.trace),
                x_label: "capacity (tokens)".into(),
                y_label: "hit rate %".into(),
                kind: PlotKind::Bars {
                    categories: t
                        .rows
                        .iter()
                        .map(|r| format!("{}", r.capacity_tokens))
                        .collect(),
                    series: vec![
                        (
                            "lru".into(),
                            t.rows.iter().map(|r| r.lru_hit_rate * 100.0).collect(),
                        ),
                        (
                            "default".into(),
                            t.rows.iter().map(|r| r.default_hit_rate * 100.0).collect(),
                        ),
                        (
                            "optimum".into(),
                            t.rows.iter().map(|r| r.optimum_hit_rate * 100.0).collect(),
                        ),
                    ],
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            block_ids: ids.to_vec(),
            blocks_to_store: ids.len(),
        }
    }

    #[test]
    fn optimum_and_unlimited_on_a_tiny_trace() {
        let t = [req(&[0, 1]), req(&[2]), req(&[0, 1, 3]), req(&[2])];
        assert!((unlimited(&t) - 3.0 / 7.0).abs() < 1e-9);
        // Two slots: keep 0 and 1 (used next) over 2 (used later); 7 blocks in all.
        assert!((optimum(&t, 2) - 2.0 / 7.0).abs() < 1e-9);
        assert!((optimum(&t, 10) - unlimited(&t)).abs() < 1e-9);
    }

    #[test]
    fn token_counts_are_decimal() {
        assert_eq!(parse_tokens("3m"), Ok(3_000_000));
        assert_eq!(parse_tokens("500k"), Ok(500_000));
        assert!(parse_tokens("100").is_err());
        assert!(parse_tokens("x").is_err());
    }

    /// `policy`'s arguments parsed from `args`.
    fn parse_args(args: &[&str]) -> Result<PolicyArgs, clap::Error> {
        use clap::Parser;
        #[derive(Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            args: PolicyArgs,
        }
        Cli::try_parse_from(std::iter::once("policy").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn capacities_are_a_list_of_token_counts() {
        let parse = |args: &[&str]| parse_args(args).map(|a| a.capacities);
        assert_eq!(
            parse(&[]).unwrap(),
            vec![1_000_000, 3_000_000, 10_000_000, 50_000_000]
        );
        assert_eq!(
            parse(&["--capacities", "1m,500k"]).unwrap(),
            vec![1_000_000, 500_000]
        );
        let e = parse(&["--capacities", "1m,100"]).unwrap_err().to_string();
        assert!(e.contains("invalid value '100' for '--capacities"), "{e}");
    }

    #[test]
    fn a_parameter_study_crosses_its_lists_with_the_defaults_for_one_left_out() {
        let grid = |args: &[&str]| {
            parse_args(args).map(|a| {
                a.grid()
                    .iter()
                    .map(|t| (t.horizon, t.protect_margin))
                    .collect::<Vec<_>>()
            })
        };
        let d = ChainAwareTuning::default();
        assert_eq!(grid(&[]).unwrap(), vec![]);
        let (two, eight) = (Horizon::Fixed(2), Horizon::Fixed(8));
        assert_eq!(
            grid(&["--horizon-slots", "2,ladder"]).unwrap(),
            vec![(two, d.protect_margin), (Horizon::Ladder, d.protect_margin)]
        );
        assert_eq!(
            grid(&["--horizon-slots", "2,8", "--protect-margin", "0,0.1"]).unwrap(),
            vec![(two, 0.0), (two, 0.1), (eight, 0.0), (eight, 0.1)]
        );
        assert_eq!(
            grid(&["--protect-margin", "0.2"]).unwrap(),
            vec![(d.horizon, 0.2)]
        );
        let modes = |args: &[&str]| {
            parse_args(args)
                .unwrap()
                .grid()
                .iter()
                .map(|t| (t.horizon, t.bimodal))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            modes(&["--bimodal", "off,on"]),
            vec![(d.horizon, false), (d.horizon, true)]
        );
        assert_eq!(
            modes(&["--horizon-slots", "2"]),
            vec![(two, ChainAwareTuning::default().bimodal)]
        );
        assert!(parse_args(&["--bimodal", "yes"]).is_err());
        for bad in [
            "--horizon-slots=0",
            "--horizon-slots=lad",
            "--protect-margin=-1",
        ] {
            let e = grid(&[bad]).unwrap_err().to_string();
            assert!(e.contains("is not a"), "{e}");
        }
    }
}
