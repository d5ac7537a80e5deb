//! `kvtier-bench tiers`: the one answer to "how fast are kvtier's tiers?". For each tier
//! (DRAM, NVMe) and block size: put and get GB/s and per-operation latency (p50/p99), in
//! process and through the sidecar (local zero-copy over its Unix socket, remote over TCP and
//! QUIC), with the references measured in the same run and the ratios printed.
//!
//! Parts (`--parts`, default `store,server`):
//!
//! * `store`, in-process:
//!   - DRAM: the store is opened without an NVMe tier, so puts and gets touch only the DRAM
//!     arena and the index. Puts use fresh keys (eviction, once the arena is full, is part of
//!     the cost); gets read a pre-filled set round-robin. Reference: memcpy of the same
//!     blocks over a working set as large as the arena, for the same time, on the same number
//!     of threads.
//!   - NVMe: both sides first fill their whole working set (untimed), so measured writes are
//!     overwrites, as in a full cache, and reads never hit unwritten extents. The reference
//!     (pwrite/pread with O_DIRECT) runs first, for the given time, on a file of
//!     `slots x block` bytes; then the tier does exactly as many operations per thread (same
//!     total bytes, same slot sequence). Each thread owns an equal share of the slots.
//! * `server`: the sidecar in a child process (`serve-child`) over each of `--transports` with
//!   each of `--clients`, for each of `--server-tiers`: DRAM (NVMe off) and NVMe (a DRAM tier
//!   of a few blocks over an NVMe tier holding the working set). See `server.rs` for the
//!   references (memcpy, raw loopback TCP, raw quinn, Redis over its Unix socket and TCP,
//!   O_DIRECT I/O for the NVMe tier), the lookup latency of a long prefix over the Unix
//!   socket, and the server's peak RSS.
//!
//! Redis is started by the bench when `redis-server` is installed (bench/install-redis.sh),
//! reached with `--redis URL`, or skipped with `--no-redis`; a skipped Redis is said so in
//! the output. Payloads and keys come from `--seed`.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use clap::builder::RangedU64ValueParser;
use indicatif::ProgressBar;
use kvtier_core::{BlockKey, KvLayout};
use kvtier_server::tier::{NvmeTierConfig, SlotId, Tier, TierKind};
use kvtier_server::{GetOutcome, PutOutcome, StoreConfig, TieredStore};
use serde::Serialize;

mod case;
mod redis;
pub mod server;

pub use case::Part;
use case::{
    Comparison, Op, RedisChoice, RedisUrl, Row, ServerTier, Settings, Transport, base_dir,
    direct_io_reference, layout_for, parse_redis_url, step,
};
use redis::Redis;

use crate::report::{Plot, PlotKind, Report, Series, Table};
use crate::util::{
    self, ALIGN, AlignedBuf, Budget, Bytes, fmt_f, fmt_ratio, parse_size, phase, sub_seed,
};

/// NVMe slot header bytes (the tier's on-disk format puts one before every payload).
const HEADER_BYTES: u64 = 4096;
const DEFAULT_NVME_MAX: u64 = 512 << 20;
const DEFAULT_DRAM_MAX: u64 = 512 << 20;
const MAX_WARMUP: Duration = Duration::from_millis(500);

/// A block size: a size (`64k`, `2m`) that is a non-zero multiple of 4 KiB.
fn parse_block_size(s: &str) -> Result<u64, String> {
    let b = parse_size(s)?;
    if b == 0 || !b.is_multiple_of(ALIGN as u64) {
        return Err(format!(
            "{b} is not a non-zero multiple of 4096 (the NVMe tier's slot unit)"
        ));
    }
    Ok(b)
}

/// Defaults (finish in about a minute on a 2-core machine) and `--quick` (a smoke test).
struct Defaults {
    sizes: &'static [u64],
    seconds_per_case: f64,
    threads: usize,
    dram_bytes: Option<u64>,
    nvme_bytes: Option<u64>,
    clients: &'static [usize],
    blocks: Option<usize>,
    lookup_blocks: usize,
    lookup_dram_blocks: usize,
}

const FULL: Defaults = Defaults {
    sizes: &[64 << 10, 2 << 20],
    seconds_per_case: 0.3,
    threads: 4,
    dram_bytes: None,
    nvme_bytes: None,
    clients: &[1, 4],
    blocks: None,
    lookup_blocks: 4096,
    lookup_dram_blocks: 1 << 18,
};

const QUICK: Defaults = Defaults {
    sizes: &[64 << 10],
    seconds_per_case: 0.05,
    threads: 2,
    dram_bytes: Some(16 << 20),
    nvme_bytes: Some(16 << 20),
    clients: &[1],
    blocks: Some(8),
    lookup_blocks: 256,
    lookup_dram_blocks: 1024,
};

#[derive(Args, Debug, Clone)]
pub struct TiersArgs {
    /// Parts to run: store (in-process tiers), server (the sidecar over its transports).
    /// [default: store,server; `server` subcommand: server]
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub parts: Option<Vec<Part>>,
    /// Transports of the server part (unix = local zero-copy, tcp, quic).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "unix,tcp,quic"
    )]
    pub transports: Vec<Transport>,
    /// Tiers the server part serves from: dram (NVMe off), nvme (a few DRAM blocks over an
    /// NVMe tier holding the working set, under --dir).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "dram,nvme")]
    pub server_tiers: Vec<ServerTier>,
    /// Block sizes (binary units, multiples of 4 KiB). [default: 64k,2m; --quick: 64k]
    #[arg(
        long,
        alias = "block-size",
        value_delimiter = ',',
        value_parser = parse_block_size,
        value_name = "LIST"
    )]
    pub sizes: Option<Vec<u64>>,
    /// Measured time of each case (warm-up comes on top). [default: 0.3; --quick: 0.05]
    #[arg(long, alias = "seconds", value_name = "SECONDS")]
    pub seconds_per_case: Option<f64>,
    /// Threads for the in-process NVMe cases (tier and pread/pwrite alike). [default: 4;
    /// --quick: 2]
    #[arg(long)]
    pub threads: Option<usize>,
    /// Threads for the in-process DRAM cases (store and memcpy alike).
    #[arg(long, default_value_t = 1)]
    pub dram_threads: usize,
    /// In-process DRAM tier capacity. [default: 512 MiB, or a quarter of available memory if
    /// less; --quick: 16m]
    #[arg(long, value_parser = parse_size)]
    pub dram_bytes: Option<u64>,
    /// In-process NVMe working set (tier capacity, and size of the reference file).
    /// [default: 512 MiB, or a quarter of the free space if less; --quick: 16m]
    #[arg(long, value_parser = parse_size)]
    pub nvme_bytes: Option<u64>,
    /// Directory for the NVMe files (a temporary directory is made inside it and removed
    /// afterwards). Must be on a real disk, not tmpfs. [default: ./kvtier-data/bench, else
    /// $TMPDIR]
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Client counts of the server part (each transport runs at each). [default: 1,4;
    /// --quick: 1]
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = RangedU64ValueParser::<usize>::new().range(1..),
        value_name = "LIST"
    )]
    pub clients: Option<Vec<usize>>,
    /// Distinct blocks the server part's clients cycle through (all in DRAM). [default:
    /// 256 MiB worth, 16 to 4096 blocks; --quick: 8]
    #[arg(long)]
    pub blocks: Option<usize>,
    /// Blocks per server request.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Blocks in the prefix whose lookup latency is measured over the Unix socket (0: skip).
    /// [default: 4096; --quick: 256]
    #[arg(long)]
    pub lookup_blocks: Option<usize>,
    /// DRAM tier of the lookup case, in 4 KiB blocks, every one filled before the prefix
    /// is stored (as a server's DRAM is in use: the published slot table and the store's
    /// index as full as they get). At least --lookup-blocks + 64.
    /// [default: 262144 (1 GiB); --quick: 1024]
    #[arg(long)]
    pub lookup_dram_blocks: Option<usize>,
    /// Run the lookup case in a tenant's namespace (a server with `[tenants]`, its one
    /// tenant the local engine: `unix`, `local_arena`), so every key is mapped to the
    /// store's on both sides.
    #[arg(long)]
    pub lookup_tenants: bool,
    /// Skip the Redis reference (said so in the output).
    #[arg(long, conflicts_with = "redis")]
    pub no_redis: bool,
    /// Use this Redis instead of starting one: redis://HOST:PORT, tcp://HOST:PORT or
    /// unix:///PATH. Its keys are prefixed `kvtier-bench:` and deleted afterwards.
    #[arg(long, value_parser = parse_redis_url, value_name = "URL")]
    pub redis: Option<RedisUrl>,
    /// A smoke test: one small block size, short cases, small working sets (explicit options
    /// still win).
    #[arg(long)]
    pub quick: bool,
    /// Local (unix) gets take a pin and a release per request, as before issue 18's item 3,
    /// instead of reading DRAM hits through the published slot table with no message.
    #[arg(long)]
    pub pin_gets: bool,
}

/// `v` without repeats, in first-seen order.
fn dedup<T: PartialEq + Copy>(v: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for x in v {
        if !out.contains(x) {
            out.push(*x);
        }
    }
    out
}

impl TiersArgs {
    /// Resolves the defaults (`--quick` or not); `default_parts` when `--parts` is absent.
    pub fn settings(&self, default_parts: &[Part], seed: u64) -> Result<Settings> {
        let d = if self.quick { &QUICK } else { &FULL };
        let seconds = self.seconds_per_case.unwrap_or(d.seconds_per_case);
        if !(seconds.is_finite() && seconds > 0.0 && seconds <= 3600.0) {
            bail!(
                "--seconds-per-case {seconds}: must be a positive number of seconds (at most 3600)"
            );
        }
        let threads = self.threads.unwrap_or(d.threads);
        if threads == 0 || self.dram_threads == 0 {
            bail!("--threads and --dram-threads must be at least 1");
        }
        if self.batch == 0 {
            bail!("--batch must be at least 1");
        }
        let blocks = self.blocks.or(d.blocks);
        if blocks == Some(0) {
            bail!("--blocks must be at least 1");
        }
        let lookup_blocks = self.lookup_blocks.unwrap_or(d.lookup_blocks);
        let lookup_dram_blocks = match self.lookup_dram_blocks {
            Some(n) if lookup_blocks > 0 && n < lookup_blocks + 64 => bail!(
                "--lookup-dram-blocks {n}: the lookup case needs at least --lookup-blocks + 64 ({})",
                lookup_blocks + 64
            ),
            Some(n) => n,
            None => d.lookup_dram_blocks.max(lookup_blocks + 64),
        };
        if u32::try_from(lookup_dram_blocks).is_err() {
            bail!("--lookup-dram-blocks {lookup_dram_blocks}: too many slots");
        }
        let parts = self
            .parts
            .as_ref()
            .map_or_else(|| default_parts.to_vec(), |p| dedup(p));
        if parts.is_empty() {
            bail!("--parts: nothing to run");
        }
        if parts.contains(&Part::Server) && self.server_tiers.is_empty() {
            bail!("--server-tiers: no tier given");
        }
        let redis = if self.no_redis {
            RedisChoice::Off
        } else if let Some(u) = &self.redis {
            RedisChoice::External(u.clone())
        } else {
            RedisChoice::Start
        };
        Ok(Settings {
            parts,
            transports: dedup(&self.transports),
            server_tiers: dedup(&self.server_tiers),
            sizes: self
                .sizes
                .as_ref()
                .map_or_else(|| d.sizes.to_vec(), Clone::clone),
            seconds_per_case: seconds,
            threads,
            dram_threads: self.dram_threads,
            dram_bytes: self.dram_bytes.or(d.dram_bytes),
            nvme_bytes: self.nvme_bytes.or(d.nvme_bytes),
            dir: self.dir.clone(),
            clients: self
                .clients
                .as_ref()
                .map_or_else(|| d.clients.to_vec(), Clone::clone),
            blocks,
            batch: self.batch,
            lookup_blocks,
            lookup_dram_blocks,
            lookup_tenants: self.lookup_tenants,
            redis,
            quick: self.quick,
            pin_gets: self.pin_gets,
            seed,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The report.

#[derive(Debug, Serialize)]
pub struct StoreSize {
    pub block_bytes: u64,
    pub layout: String,
    pub dram: DramInfo,
    pub nvme: NvmeInfo,
}

#[derive(Debug, Serialize)]
pub struct DramInfo {
    pub capacity_bytes: u64,
    pub slots: u32,
    /// Evictions the puts caused.
    pub put_evictions: u64,
    /// Blocks stored before the get case.
    pub get_prefilled: u64,
}

#[derive(Debug, Serialize)]
pub struct NvmeInfo {
    pub slots: u64,
    pub stride_bytes: u64,
    pub working_set_bytes: u64,
    /// Whether the tier opened its files with O_DIRECT (`NvmeOpenReport::direct_io`).
    pub tier_direct_io: bool,
    /// Whether the reference file was opened with O_DIRECT.
    pub raw_direct_io: bool,
    /// Slots (over all threads) the measured cases cycle over, all written beforehand.
    pub used_slots: u64,
    /// Size of the reference file (`used_slots x block`).
    pub reference_file_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct StoreInfo {
    pub dir: String,
    pub fs_type: String,
    pub free_bytes: u64,
    pub dram_bytes: u64,
    pub nvme_bytes: u64,
    pub sizes: Vec<StoreSize>,
}

#[derive(Debug, Serialize)]
pub struct TiersReport {
    pub settings: Settings,
    /// Every measured case, kvtier's and the references'.
    pub rows: Vec<Row>,
    pub comparisons: Vec<Comparison>,
    pub store: Option<StoreInfo>,
    pub server: Option<server::ServerInfo>,
    /// What Redis was: started, external, or skipped and why.
    pub redis: String,
    pub notes: Vec<String>,
    pub total_seconds: f64,
}

/// The short label of a row in plots and tables.
fn label(path: &str, threads: usize) -> String {
    format!("{path} x{threads}")
}

impl Report for TiersReport {
    fn tables(&self) -> Vec<Table> {
        let mut out = Vec::new();
        // One left-aligned column: values are long and of every kind.
        let mut run = Table::new("run", &["setting: value"]);
        let mut kv = |k: &str, v: String| run.row([format!("{k}: {v}")]);
        kv(
            "parts",
            join(&self.settings.parts, |p| format!("{p:?}").to_lowercase()),
        );
        kv(
            "seconds per case",
            self.settings.seconds_per_case.to_string(),
        );
        if let Some(s) = &self.store {
            kv(
                "store dir",
                format!("{} (fs {}, {} free)", s.dir, s.fs_type, Bytes(s.free_bytes)),
            );
            kv(
                "store threads",
                format!(
                    "dram {} / nvme {}",
                    self.settings.dram_threads, self.settings.threads
                ),
            );
            kv(
                "store capacity",
                format!(
                    "dram tier {}, nvme working set {}",
                    Bytes(s.dram_bytes),
                    Bytes(s.nvme_bytes)
                ),
            );
        }
        if self.settings.parts.contains(&Part::Server) {
            kv(
                "server",
                format!(
                    "tiers {}, transports {}, clients {}, {} block(s) a request",
                    join(&self.settings.server_tiers, |t| t.name().to_string()),
                    join(&self.settings.transports, |t| t.name().to_string()),
                    join(&self.settings.clients, ToString::to_string),
                    self.settings.batch
                ),
            );
            kv("redis", self.redis.clone());
        }
        for n in &self.notes {
            kv("note", n.clone());
        }
        kv("total time", format!("{:.1} s", self.total_seconds));
        out.push(run);

        let mut t = Table::new(
            "throughput and latency per operation (kvtier and references, same run)",
            &[
                "path", "op", "block", "thr", "GB/s", "ops/s", "p50 us", "p99 us", "failed",
            ],
        );
        for r in &self.rows {
            t.row([
                r.path.clone(),
                r.op.name().into(),
                Bytes(r.block_bytes).to_string(),
                r.threads.to_string(),
                fmt_f(r.figure.gb_per_s, 2),
                fmt_f(r.figure.ops_per_s, 0),
                fmt_f(r.figure.latency_us_p50, 1),
                fmt_f(r.figure.latency_us_p99, 1),
                r.failed_ops.to_string(),
            ]);
        }
        out.push(t);

        let mut c = Table::new(
            "ratios: kvtier GB/s over the reference's (target from docs/benchmarks.md where it names one)",
            &[
                "path",
                "op",
                "block",
                "thr",
                "GB/s",
                "reference",
                "ref GB/s",
                "ratio",
                "target",
            ],
        );
        for x in &self.comparisons {
            c.row([
                x.path.clone(),
                x.op.name().into(),
                Bytes(x.block_bytes).to_string(),
                x.threads.to_string(),
                fmt_f(x.gb_per_s, 2),
                label(&x.reference, x.reference_threads),
                fmt_f(x.reference_gb_per_s, 2),
                fmt_ratio(x.ratio),
                match (x.target, x.meets_target) {
                    (Some(t), Some(true)) => format!(">= {t}x: met"),
                    (Some(t), Some(false)) => format!(">= {t}x: MISSED"),
                    (Some(t), None) => format!(">= {t}x: no reference"),
                    (None, _) => String::new(),
                },
            ]);
        }
        out.push(c);

        if let Some(s) = &self.store {
            let mut d = Table::new(
                "store details",
                &[
                    "block",
                    "layout",
                    "dram slots",
                    "put evictions",
                    "nvme slots",
                    "nvme used",
                    "O_DIRECT tier/ref",
                ],
            );
            for z in &s.sizes {
                d.row([
                    Bytes(z.block_bytes).to_string(),
                    z.layout.clone(),
                    z.dram.slots.to_string(),
                    z.dram.put_evictions.to_string(),
                    z.nvme.slots.to_string(),
                    z.nvme.used_slots.to_string(),
                    format!("{}/{}", z.nvme.tier_direct_io, z.nvme.raw_direct_io),
                ]);
            }
            out.push(d);
        }
        if let Some(s) = &self.server {
            out.extend(s.tables());
        }
        out
    }

    fn plots(&self) -> Vec<Plot> {
        let mut plots = Vec::new();
        for op in [Op::Get, Op::Put] {
            let rows = || self.rows.iter().filter(move |r| r.op == op);
            let per_row = |what: fn(&Row) -> f64| {
                lines(rows().map(|r| (label(&r.path, r.threads), r.block_bytes, what(r))))
            };
            let mut add = |file: &str, title: String, y: &str, series: Vec<Series>| {
                if !series.is_empty() {
                    plots.push(Plot {
                        file: format!("tiers-{}-{file}", op.name()),
                        title,
                        x_label: "block size".into(),
                        y_label: y.into(),
                        kind: PlotKind::Lines {
                            series,
                            log_x: true,
                        },
                    });
                }
            };
            let n = op.name();
            add(
                "gbps",
                format!("{n} GB/s by block size: kvtier and its references"),
                "GB/s",
                per_row(|r| r.figure.gb_per_s),
            );
            for part in [Part::Store, Part::Server] {
                let series = lines(rows().filter(|r| r.part == part).map(|r| {
                    (
                        label(&r.path, r.threads),
                        r.block_bytes,
                        r.figure.latency_us_p50,
                    )
                }));
                let p = format!("{part:?}").to_lowercase();
                add(
                    &format!("{p}-p50"),
                    format!("{n} latency p50 per operation ({p} part)"),
                    "microseconds",
                    series,
                );
                let series = lines(rows().filter(|r| r.part == part).map(|r| {
                    (
                        label(&r.path, r.threads),
                        r.block_bytes,
                        r.figure.latency_us_p99,
                    )
                }));
                add(
                    &format!("{p}-p99"),
                    format!("{n} latency p99 per operation ({p} part)"),
                    "microseconds",
                    series,
                );
            }
            add(
                "ratios",
                format!("{n}: kvtier GB/s over its reference (1.0 = as fast)"),
                "ratio",
                lines(self.comparisons.iter().filter(|c| c.op == op).map(|c| {
                    (
                        short(&format!("{} x{} / {}", c.path, c.threads, c.reference)),
                        c.block_bytes,
                        c.ratio.unwrap_or(f64::NAN),
                    )
                })),
            );
        }
        plots
    }
}

/// Series of (name, block size, value) points, in order of first appearance, by block size.
fn lines(points: impl Iterator<Item = (String, u64, f64)>) -> Vec<Series> {
    let mut series: Vec<Series> = Vec::new();
    for (name, x, y) in points {
        let point = (x as f64, y);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![point],
            }),
        }
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    series
}

/// Abbreviates a plot label so grouped bars stay readable.
fn short(s: &str) -> String {
    s.replace("kvtier ", "")
        .replace(", in-process", " inproc")
        .replace("raw loopback TCP", "raw tcp")
        .replace("(unix socket)", "unix")
        .replace("(tcp)", "tcp")
}

fn join<T>(v: &[T], f: impl Fn(&T) -> String) -> String {
    v.iter().map(f).collect::<Vec<_>>().join(",")
}

// ---------------------------------------------------------------------------------------
// The run.

/// Runs the parts `args` selects (`default_parts` when `--parts` is absent).
pub fn run(args: &TiersArgs, default_parts: &[Part], seed: u64) -> Result<TiersReport> {
    let t0 = Instant::now();
    let s = args.settings(default_parts, seed)?;
    let mut notes = Vec::new();
    let mut rows = Vec::new();
    let mut comparisons = Vec::new();

    let want_server = s.parts.contains(&Part::Server);
    let (redis, redis_status) = if !want_server {
        (None, "not used (no server part)".to_string())
    } else {
        match &s.redis {
            RedisChoice::Off => (None, "SKIPPED: --no-redis".to_string()),
            RedisChoice::External(u) => {
                let r = Redis::external(u, seed)?;
                let l = r.label.clone();
                (Some(r), l)
            }
            RedisChoice::Start => match Redis::start(seed)? {
                Some(r) => {
                    let l = r.label.clone();
                    (Some(r), l)
                }
                None => (
                    None,
                    "SKIPPED: redis-server is not on PATH (bench/install-redis.sh installs it; \
                     or give --redis URL)"
                        .to_string(),
                ),
            },
        }
    };
    if want_server && redis.is_none() {
        eprintln!("kvtier-bench: Redis reference {redis_status}");
    }

    let mut steps = 0;
    if s.parts.contains(&Part::Store) {
        steps += STORE_STEPS * s.sizes.len() as u64;
    }
    if want_server {
        steps += server::steps(&s, redis.as_ref());
    }
    let bar = crate::report::bar(steps, "tiers");

    let store = if s.parts.contains(&Part::Store) {
        let st = run_store(&s, &bar, &mut rows, &mut comparisons, &mut notes)?;
        Some(st)
    } else {
        None
    };
    let server = if want_server {
        let sp = server::measure(&s, redis.as_ref(), &bar)?;
        rows.extend(sp.rows);
        comparisons.extend(sp.comparisons);
        notes.extend(sp.notes);
        Some(sp.info)
    } else {
        None
    };
    bar.finish_and_clear();
    if let Some(r) = redis {
        r.stop()?;
    }
    Ok(TiersReport {
        settings: s,
        rows,
        comparisons,
        store,
        server,
        redis: redis_status,
        notes,
        total_seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Timed or filling phases per block size in the store part (for the progress bar).
const STORE_STEPS: u64 = 10;

fn describe(l: &KvLayout) -> String {
    format!(
        "{} layers x {} kv heads x {} dim x {} tokens, bf16",
        l.num_layers(),
        l.num_kv_heads(),
        l.head_dim(),
        l.block_tokens()
    )
}

fn run_store(
    s: &Settings,
    bar: &ProgressBar,
    rows: &mut Vec<Row>,
    comparisons: &mut Vec<Comparison>,
    notes: &mut Vec<String>,
) -> Result<StoreInfo> {
    let run_time = s.case_time();
    let budget = Budget::Time {
        warm: MAX_WARMUP.min(run_time / 4),
        run: run_time,
    };
    let base = base_dir(s.dir.as_deref())?;
    let work = tempfile::Builder::new()
        .prefix("kvtier-bench-")
        .tempdir_in(&base)
        .with_context(|| format!("{} is not writable", base.display()))?;
    let dir = work.path().to_owned();
    let fs_type = util::fs_type(&dir)?;
    let free = util::free_bytes(&dir)?;
    if util::is_memory_fs(&fs_type) {
        let n = format!(
            "{} is on {fs_type}: the NVMe figures measure memory, not a disk",
            dir.display()
        );
        bar.suspend(|| eprintln!("warning: {n}"));
        notes.push(n);
    }
    let max_block = s.sizes.iter().copied().max().unwrap_or(ALIGN as u64);
    let dram_bytes = match s.dram_bytes {
        Some(b) => b,
        None => {
            let avail = util::mem_available().unwrap_or(4 * DEFAULT_DRAM_MAX);
            DEFAULT_DRAM_MAX.min(avail / 4)
        }
    };
    if dram_bytes < 2 * max_block {
        bail!(
            "--dram-bytes {} holds fewer than 2 blocks of {}",
            Bytes(dram_bytes),
            Bytes(max_block)
        );
    }
    let nvme_bytes = s
        .nvme_bytes
        .unwrap_or_else(|| DEFAULT_NVME_MAX.min(free / 4));
    if nvme_bytes > free / 10 * 9 {
        bail!(
            "--nvme-bytes {} would (nearly) fill {} ({} free)",
            Bytes(nvme_bytes),
            dir.display(),
            Bytes(free)
        );
    }
    let mut sizes = Vec::new();
    for &block in &s.sizes {
        let z = store_size(
            s,
            &budget,
            bar,
            &dir,
            block,
            dram_bytes,
            nvme_bytes,
            rows,
            comparisons,
        )
        .with_context(|| format!("store part, {} blocks", Bytes(block)))?;
        sizes.push(z);
    }
    let dir_shown = dir.display().to_string();
    work.close()
        .with_context(|| format!("removing {dir_shown}"))?;
    Ok(StoreInfo {
        dir: dir_shown,
        fs_type,
        free_bytes: free,
        dram_bytes,
        nvme_bytes,
        sizes,
    })
}

/// Keys of the store part: stream `tag` of the run's seed, numbered by `i`.
fn store_key(seed: u64, tag: u64, i: u64) -> BlockKey {
    BlockKey::from_u128((u128::from(sub_seed(seed, tag)) << 64) | u128::from(i))
}

#[allow(clippy::too_many_arguments)]
fn store_size(
    s: &Settings,
    budget: &Budget<'_>,
    bar: &ProgressBar,
    dir: &Path,
    block: u64,
    dram_bytes: u64,
    nvme_bytes: u64,
    rows: &mut Vec<Row>,
    comparisons: &mut Vec<Comparison>,
) -> Result<StoreSize> {
    let layout = layout_for(block)?;
    let bs = usize::try_from(block)?;
    let seed = s.seed;
    let sz = Bytes(block);

    // ---- DRAM ----
    let dt = s.dram_threads;
    let mut cfg = StoreConfig::new(layout, dram_bytes);
    cfg.dram_prefault = true;
    cfg.nvme = None;
    cfg.io_threads = 1;
    let (store, _open) = TieredStore::open(cfg).context("opening the store (DRAM only)")?;
    let slots = store.dram().slot_count();
    if (slots as usize) < dt.max(2) {
        bail!(
            "the DRAM tier holds {slots} blocks; need at least {}",
            dt.max(2)
        );
    }

    // The memcpy reference moves the same bytes over the same working set: block j of a
    // region as large as the arena (per thread, its share) to or from one buffer. Copying
    // one buffer pair over and over would measure the CPU cache, not memory.
    let region_blocks = (u64::from(slots) / dt as u64).max(1);
    let region_setup = |t: usize, tag: u64| -> Result<(AlignedBuf, AlignedBuf)> {
        let region = util::random_buf(bs * region_blocks as usize, sub_seed(seed, tag + t as u64));
        Ok((
            region,
            util::random_buf(bs, sub_seed(seed, tag + 50 + t as u64)),
        ))
    };
    let memcpy_get = step(bar, format!("{sz}: memcpy get x{dt}"), || {
        phase(
            dt,
            budget,
            |t| region_setup(t, 300),
            |(region, buf), _, i| {
                let j = (i % region_blocks) as usize;
                buf.copy_from_slice(&region[j * bs..(j + 1) * bs]);
                black_box(buf.as_ptr());
                Ok(true)
            },
        )
    })?;
    let memcpy_put = step(bar, format!("{sz}: memcpy put x{dt}"), || {
        phase(
            dt,
            budget,
            |t| region_setup(t, 400),
            |(region, buf), _, i| {
                let j = (i % region_blocks) as usize;
                region[j * bs..(j + 1) * bs].copy_from_slice(buf);
                black_box(region.as_ptr());
                Ok(true)
            },
        )
    })?;

    // Gets first: their pre-fill writes every slot once, so the puts that follow do not
    // pay the arena's first-touch page faults (a long-running server has paid them).
    let prefill = u64::from(slots);
    {
        let src = util::random_buf(bs, sub_seed(seed, 200));
        for i in 0..prefill {
            match store.put(store_key(seed, 1, i), None, &src)? {
                PutOutcome::Stored(_) => {}
                other => bail!("pre-filling block {i} of {prefill}: {other:?}"),
            }
        }
    }
    let per_thread = |t: usize| (prefill - t as u64).div_ceil(dt as u64);
    let get = step(bar, format!("{sz}: dram get x{dt}"), || {
        phase(
            dt,
            budget,
            |_| Ok(AlignedBuf::new(bs)),
            |buf, t, i| {
                let j = t as u64 + (i % per_thread(t)) * dt as u64;
                Ok(matches!(
                    store.get(&store_key(seed, 1, j), buf)?,
                    GetOutcome::Hit(TierKind::Dram)
                ))
            },
        )
    })?;
    store.clear().context("clearing the store")?;
    let put = step(bar, format!("{sz}: dram put x{dt}"), || {
        phase(
            dt,
            budget,
            |t| Ok(util::random_buf(bs, sub_seed(seed, 100 + t as u64))),
            |src, t, i| {
                let key = store_key(seed, 1000 + t as u64, i);
                match store.put(key, None, src)? {
                    PutOutcome::Stored(_) => Ok(true),
                    PutOutcome::Rejected(_) => Ok(false),
                    PutOutcome::AlreadyPresent => {
                        bail!("put of a fresh key {key} found it present")
                    }
                }
            },
        )
    })?;
    let put_evictions = store
        .stats()
        .tier(TierKind::Dram)
        .map_or(0, |st| st.evictions);
    drop(store);

    let path = "kvtier dram, in-process";
    let pairs = [(Op::Put, &put, &memcpy_put), (Op::Get, &get, &memcpy_get)];
    for (op, kv, reference) in pairs {
        let a = Row::new(Part::Store, path, true, op, block, dt).with_phase(kv);
        let b = Row::new(Part::Store, "memcpy", false, op, block, dt).with_phase(reference);
        comparisons.push(Comparison::of(&a, &b, None));
        rows.push(a);
        rows.push(b);
    }
    let dram = DramInfo {
        capacity_bytes: dram_bytes,
        slots,
        put_evictions,
        get_prefilled: prefill,
    };

    // ---- NVMe ----
    let nt = s.threads;
    let stride = HEADER_BYTES + block;
    let nslots = nvme_bytes / stride;
    let per = nslots / nt as u64;
    if per == 0 {
        bail!(
            "--nvme-bytes {} holds {nslots} slots of {}: fewer than --threads {nt}",
            Bytes(nvme_bytes),
            Bytes(stride)
        );
    }
    let file_len = nslots * stride;
    let slot_of = |t: usize, i: u64| t as u64 * per + i % per;
    let key_of = |slot: u64| store_key(seed, 2, slot);

    let raw_len = nt as u64 * per * block;
    let (raw_w, raw_r, raw_direct) = direct_io_reference(dir, block, nt, per, budget, seed, bar)?;
    let src = |t: usize| Ok(util::random_buf(bs, sub_seed(seed, 500 + t as u64)));

    let tier_dir = dir.join(format!("tier-{block}"));
    let (tier, report) = NvmeTierConfig::new(&tier_dir, file_len, block, layout.fingerprint())
        .open()
        .with_context(|| format!("opening the NVMe tier in {}", tier_dir.display()))?;
    if u64::from(tier.slot_count()) != nslots {
        bail!(
            "the NVMe tier has {} slots, expected {nslots}",
            tier.slot_count()
        );
    }
    let tier_write = |buf: &mut AlignedBuf, t: usize, i: u64| -> Result<bool> {
        let slot = slot_of(t, i);
        tier.write(SlotId(u32::try_from(slot)?), key_of(slot), buf)
            .with_context(|| format!("tier write of slot {slot}"))?;
        Ok(true)
    };
    step(bar, format!("{sz}: filling the NVMe tier"), || {
        phase(nt, &Budget::Fixed(per), src, tier_write)
    })?;
    let tier_w = step(bar, format!("{sz}: nvme tier write x{nt}"), || {
        phase(nt, &Budget::Match(&raw_w), src, tier_write)
    })?;
    let tier_r = step(bar, format!("{sz}: nvme tier read x{nt}"), || {
        phase(
            nt,
            &Budget::Match(&raw_r),
            |_| Ok(AlignedBuf::new(bs)),
            |buf, t, i| {
                let slot = slot_of(t, i);
                tier.read(SlotId(u32::try_from(slot)?), key_of(slot), buf)
                    .with_context(|| format!("tier read of slot {slot}"))?;
                Ok(true)
            },
        )
    })?;
    drop(tier);
    std::fs::remove_dir_all(&tier_dir)
        .with_context(|| format!("removing {}", tier_dir.display()))?;

    let path = "kvtier nvme tier, in-process";
    let io = if raw_direct { "O_DIRECT" } else { "buffered" };
    for (op, kv, r) in [(Op::Put, &tier_w, &raw_w), (Op::Get, &tier_r, &raw_r)] {
        let a = Row::new(Part::Store, path, true, op, block, nt).with_phase(kv);
        let reference = match op {
            Op::Put => format!("{io} pwrite"),
            Op::Get => format!("{io} pread"),
        };
        let b = Row::new(Part::Store, &reference, false, op, block, nt).with_phase(r);
        comparisons.push(Comparison::of(&a, &b, Some(0.8)));
        rows.push(a);
        rows.push(b);
    }

    Ok(StoreSize {
        block_bytes: block,
        layout: describe(&layout),
        dram,
        nvme: NvmeInfo {
            slots: nslots,
            stride_bytes: stride,
            working_set_bytes: file_len,
            tier_direct_io: report.direct_io,
            raw_direct_io: raw_direct,
            used_slots: nt as u64 * per,
            reference_file_bytes: raw_len,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::Figure;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: TiersArgs,
    }

    fn parse(args: &[&str]) -> Result<TiersArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("tiers").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn layouts_match_block_sizes() {
        for bytes in [
            4096,
            12 << 10,
            64 << 10,
            2 << 20,
            16 << 20,
            64 << 20,
            96 << 20,
        ] {
            let l = layout_for(bytes).unwrap();
            assert_eq!(l.block_bytes(), bytes, "{}", describe(&l));
        }
        let l = layout_for(64 << 10).unwrap();
        assert_eq!(
            (l.num_layers(), l.num_kv_heads(), l.head_dim()),
            (1, 8, 128)
        );
        assert!(layout_for(0).is_err());
        assert!(layout_for(1000).is_err());
    }

    #[test]
    fn defaults_and_quick_mode() {
        let s = parse(&[])
            .unwrap()
            .settings(&[Part::Store, Part::Server], 7)
            .unwrap();
        assert_eq!(s.parts, vec![Part::Store, Part::Server]);
        assert_eq!(s.sizes, vec![64 << 10, 2 << 20]);
        assert_eq!(s.clients, vec![1, 4]);
        assert_eq!(
            s.transports,
            vec![Transport::Unix, Transport::Tcp, Transport::Quic]
        );
        assert!(matches!(s.redis, RedisChoice::Start));
        assert_eq!(s.blocks_for(2 << 20), 128);
        assert_eq!(s.blocks_for(64 << 10), 4096);
        assert_eq!(s.seed, 7);
        let q = parse(&["--quick", "--no-redis", "--seconds", "0.2"])
            .unwrap()
            .settings(&[Part::Server], 1)
            .unwrap();
        assert_eq!(q.parts, vec![Part::Server]);
        assert_eq!(q.sizes, vec![64 << 10]);
        assert_eq!(q.seconds_per_case, 0.2, "an explicit option beats --quick");
        assert_eq!(q.blocks_for(64 << 10), 8);
        assert!(matches!(q.redis, RedisChoice::Off));
        // The old `server` spellings still parse.
        let o = parse(&[
            "--block-size",
            "256k",
            "--clients",
            "1",
            "--blocks",
            "8",
            "--lookup-blocks",
            "256",
        ])
        .unwrap()
        .settings(&[Part::Server], 1)
        .unwrap();
        assert_eq!(
            (
                o.sizes.clone(),
                o.blocks,
                o.lookup_blocks,
                o.lookup_dram_blocks
            ),
            (vec![256 << 10], Some(8), 256, 1 << 18)
        );
        let p = parse(&["--parts", "server,store,server", "--transports", "tcp"]).unwrap();
        let p = p.settings(&[Part::Store], 1).unwrap();
        assert_eq!(p.parts, vec![Part::Server, Part::Store]);
        assert_eq!(p.transports, vec![Transport::Tcp]);
    }

    /// Each bad value is refused with a message naming the option or the value.
    #[test]
    fn bad_arguments_are_refused_clearly() {
        fn check(args: &[&str], needle: &str) {
            let msg = match parse(args) {
                Err(e) => e.to_string(),
                Ok(a) => match a.settings(&[Part::Store, Part::Server], 1) {
                    Err(e) => format!("{e:#}"),
                    Ok(_) => panic!("{args:?} was accepted"),
                },
            };
            assert!(msg.contains(needle), "{args:?}: {msg:?} lacks {needle:?}");
        }
        check(
            &["--parts", "store,disk"],
            "invalid value 'disk' for '--parts",
        );
        check(&["--transports", "unix,rdma"], "invalid value 'rdma'");
        check(
            &["--lookup-blocks", "100", "--lookup-dram-blocks", "150"],
            "--lookup-dram-blocks 150: the lookup case needs at least --lookup-blocks + 64 (164)",
        );
        check(&["--server-tiers", "dram,hbm"], "invalid value 'hbm'");
        check(
            &["--sizes", "64k,1000"],
            "1000 is not a non-zero multiple of 4096",
        );
        check(&["--sizes", "64k,,2m"], "--sizes");
        check(&["--clients", "1,0"], "invalid value '0' for '--clients");
        check(&["--clients", "x"], "invalid value 'x' for '--clients");
        check(&["--seconds-per-case", "0"], "--seconds-per-case");
        check(&["--seconds-per-case", "nan"], "--seconds-per-case");
        check(&["--threads", "0"], "--threads");
        check(&["--batch", "0"], "--batch");
        check(&["--blocks", "0"], "--blocks");
        check(
            &["--no-redis", "--redis", "redis://127.0.0.1:6379"],
            "--redis",
        );
        check(&["--redis", "http://x"], "redis://HOST:PORT");
    }

    #[test]
    fn comparisons_divide_and_check_targets() {
        let mut l = util::Latency::new();
        l.record(Duration::from_micros(100));
        let fig = |gb: f64| Figure::new((gb * 1e3) as u64, 1_000_000, Duration::from_secs(1), &l);
        let a =
            Row::new(Part::Server, "kvtier dram, tcp", true, Op::Get, 1 << 20, 4).with(fig(3.0), 0);
        let b = Row::new(Part::Server, "raw loopback TCP", false, Op::Get, 1 << 20, 4)
            .with(fig(4.0), 0);
        let c = Comparison::of(&a, &b, Some(0.8));
        assert!((c.ratio.unwrap() - 0.75).abs() < 1e-9);
        assert_eq!(c.meets_target, Some(false));
        let c = Comparison::of(&b, &a, Some(0.8));
        assert_eq!(c.meets_target, Some(true));
        let none = Row::new(Part::Server, "redis (tcp)", false, Op::Get, 1 << 20, 4);
        let c = Comparison::of(&a, &none, Some(1.0));
        assert_eq!((c.ratio, c.meets_target), (None, None));
    }

    #[test]
    fn report_renders_tables_and_plots() {
        let mut l = util::Latency::new();
        l.record(Duration::from_micros(40));
        let mut rows = Vec::new();
        for block in [64u64 << 10, 2 << 20] {
            let f = Figure::new(1000, block, Duration::from_secs(1), &l);
            rows.push(
                Row::new(
                    Part::Store,
                    "kvtier dram, in-process",
                    true,
                    Op::Get,
                    block,
                    1,
                )
                .with(f.clone(), 0),
            );
            rows.push(Row::new(Part::Store, "memcpy", false, Op::Get, block, 1).with(f, 0));
        }
        let comparisons = vec![
            Comparison::of(&rows[0], &rows[1], None),
            Comparison::of(&rows[2], &rows[3], None),
        ];
        let r = TiersReport {
            settings: parse(&["--no-redis"])
                .unwrap()
                .settings(&[Part::Store], 1)
                .unwrap(),
            rows,
            comparisons,
            store: None,
            server: None,
            redis: "SKIPPED: --no-redis".into(),
            notes: vec![],
            total_seconds: 1.0,
        };
        let text: String = r.tables().iter().map(Table::render).collect();
        assert!(text.contains("1.00x"), "{text}");
        assert!(text.contains("kvtier dram, in-process"));
        let plots = r.plots();
        let files: Vec<&str> = plots.iter().map(|p| p.file.as_str()).collect();
        assert_eq!(
            files,
            [
                "tiers-get-gbps",
                "tiers-get-store-p50",
                "tiers-get-store-p99",
                "tiers-get-ratios"
            ]
        );
        let PlotKind::Lines { series, .. } = &plots[3].kind else {
            panic!("ratios are lines")
        };
        assert_eq!(series.len(), 1);
        assert_eq!(series[0].points, vec![(65536.0, 1.0), (2097152.0, 1.0)]);
        assert!(plots[0].svg().contains("memcpy x1"));
    }
}
