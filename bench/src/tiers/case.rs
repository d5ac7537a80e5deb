//! What the parts of `kvtier-bench tiers` share: the run's settings, the measured rows and
//! comparisons, the block layouts, the directory to run in, and the O_DIRECT reference both the
//! store part and the server part's NVMe tier are measured against, and where to reach a
//! Redis. The driver (`mod.rs`), the server part (`server.rs`) and the Redis reference
//! (`redis.rs`) build on this module; it uses none of them.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::ValueEnum;
use indicatif::ProgressBar;
use kvtier_core::{Dtype, KvLayout};
use serde::Serialize;

use crate::util::{self, ALIGN, AlignedBuf, Budget, Bytes, Figure, Phase, phase, ratio, sub_seed};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    /// The store in-process (DRAM and NVMe tiers) against memcpy and O_DIRECT I/O.
    Store,
    /// The sidecar over its transports against memcpy, raw sockets, raw quinn and Redis.
    Server,
}

/// How a client reaches the sidecar.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The local Unix socket, blocks copied straight from the mapped arena (zero-copy).
    Unix,
    /// Remote: TCP with a token.
    Tcp,
    /// Remote: QUIC (TLS).
    Quic,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Unix => "unix",
            Transport::Tcp => "tcp",
            Transport::Quic => "quic",
        }
    }
}

/// The tier the server part's blocks live in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ServerTier {
    /// DRAM only (NVMe off): gets hit DRAM.
    Dram,
    /// A DRAM tier of a few blocks over an NVMe tier (write-through) holding the working
    /// set: gets come from NVMe (and are promoted), puts are written through to NVMe.
    Nvme,
}

impl ServerTier {
    pub fn name(self) -> &'static str {
        match self {
            ServerTier::Dram => "dram",
            ServerTier::Nvme => "nvme",
        }
    }
}

/// Longest any single request (kvtier, Redis, raw socket) may take before the run fails.
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting (or a server starting) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where to reach a Redis given with `--redis`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RedisUrl {
    Tcp(String),
    Unix(PathBuf),
}

/// Parses `redis://HOST:PORT`, `tcp://HOST:PORT` or `unix:///PATH`.
pub fn parse_redis_url(s: &str) -> Result<RedisUrl, String> {
    let bad = || {
        format!("{s:?} is not a Redis address (redis://HOST:PORT, tcp://HOST:PORT or unix:///PATH)")
    };
    if let Some(p) = s.strip_prefix("unix://") {
        if !p.starts_with('/') {
            return Err(bad());
        }
        return Ok(RedisUrl::Unix(PathBuf::from(p)));
    }
    let hp = s
        .strip_prefix("redis://")
        .or_else(|| s.strip_prefix("tcp://"))
        .ok_or_else(bad)?
        .trim_end_matches('/');
    match hp.rsplit_once(':') {
        Some((h, p))
            if !h.is_empty() && !h.contains('@') && p.parse::<u16>().is_ok_and(|p| p > 0) =>
        {
            Ok(RedisUrl::Tcp(hp.to_string()))
        }
        _ => Err(bad()),
    }
}

/// How Redis is reached, or why it is not.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RedisChoice {
    /// Start `redis-server` when installed.
    Start,
    /// Use this instance.
    External(RedisUrl),
    /// `--no-redis`.
    Off,
}

/// Every setting of the run, defaults resolved.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub parts: Vec<Part>,
    pub transports: Vec<Transport>,
    pub server_tiers: Vec<ServerTier>,
    pub sizes: Vec<u64>,
    pub seconds_per_case: f64,
    pub threads: usize,
    pub dram_threads: usize,
    pub dram_bytes: Option<u64>,
    pub nvme_bytes: Option<u64>,
    #[serde(skip)]
    pub dir: Option<PathBuf>,
    pub clients: Vec<usize>,
    pub blocks: Option<usize>,
    pub batch: usize,
    pub lookup_blocks: usize,
    /// The lookup case's DRAM tier, in 4 KiB blocks, filled before the prefix is stored
    /// (at least `lookup_blocks` + 64).
    pub lookup_dram_blocks: usize,
    /// The lookup case's server has `[tenants]`: the lookups are a tenant's (its Unix
    /// client, trusted with the arena), whose keys the server and the client map.
    pub lookup_tenants: bool,
    pub redis: RedisChoice,
    pub quick: bool,
    /// Local gets through pins (the path before the published slot table).
    pub pin_gets: bool,
    pub seed: u64,
}

impl Settings {
    /// The server part's working set at `block` bytes a block.
    pub fn blocks_for(&self, block: u64) -> usize {
        self.blocks
            .unwrap_or_else(|| ((256u64 << 20) / block).clamp(16, 4096) as usize)
            .max(self.batch)
    }

    pub fn case_time(&self) -> Duration {
        Duration::from_secs_f64(self.seconds_per_case)
    }
}

/// get or put (the NVMe tier's read and write are its get and put).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Get,
    Put,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::Put => "put",
        }
    }
}

/// One measured case: kvtier on some path, or a reference.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub part: Part,
    /// What was measured: `kvtier dram, tcp`, `raw loopback TCP`, `redis (unix socket)`...
    pub path: String,
    /// Whether this is kvtier (else a reference).
    pub kvtier: bool,
    pub op: Op,
    pub block_bytes: u64,
    /// Threads (in-process) or clients (server).
    pub threads: usize,
    #[serde(flatten)]
    pub figure: Figure,
    /// Operations that did not do their work (rejected puts, missed gets); not counted.
    pub failed_ops: u64,
}

impl Row {
    pub fn new(part: Part, path: &str, kvtier: bool, op: Op, block: u64, threads: usize) -> Self {
        Self {
            part,
            path: path.to_owned(),
            kvtier,
            op,
            block_bytes: block,
            threads,
            figure: Figure::new(0, 0, Duration::ZERO, &util::Latency::new()),
            failed_ops: 0,
        }
    }

    pub fn with(mut self, figure: Figure, failed_ops: u64) -> Self {
        self.figure = figure;
        self.failed_ops = failed_ops;
        self
    }

    pub(crate) fn with_phase(self, p: &Phase) -> Self {
        let block = self.block_bytes;
        let bad = p.bad;
        self.with(p.figure(block), bad)
    }
}

/// kvtier on one path over a reference measured in the same run.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub path: String,
    pub op: Op,
    pub block_bytes: u64,
    pub threads: usize,
    pub gb_per_s: f64,
    pub reference: String,
    pub reference_threads: usize,
    pub reference_gb_per_s: f64,
    /// kvtier GB/s over reference GB/s (absent when the reference measured nothing).
    pub ratio: Option<f64>,
    /// The ratio the targets (docs/benchmarks.md, "The targets") ask for, where they name one.
    pub target: Option<f64>,
    pub meets_target: Option<bool>,
}

impl Comparison {
    pub fn of(subject: &Row, reference: &Row, target: Option<f64>) -> Self {
        let r = ratio(subject.figure.gb_per_s, reference.figure.gb_per_s);
        Self {
            path: subject.path.clone(),
            op: subject.op,
            block_bytes: subject.block_bytes,
            threads: subject.threads,
            gb_per_s: subject.figure.gb_per_s,
            reference: reference.path.clone(),
            reference_threads: reference.threads,
            reference_gb_per_s: reference.figure.gb_per_s,
            ratio: r,
            target,
            meets_target: target.and_then(|t| r.map(|r| r >= t)),
        }
    }
}

/// A layout whose blocks are exactly `bytes` long (bf16, K and V): 8 KV heads of 128 and 16
/// tokens per block where the size allows, else other factors.
pub fn layout_for(bytes: u64) -> Result<KvLayout> {
    if bytes == 0 || !bytes.is_multiple_of(ALIGN as u64) {
        bail!("block size {bytes} is not a non-zero multiple of 4096");
    }
    // Elements per (layer, K/V): bytes / (2 tensors * 2 bytes), then / 16 tokens.
    let m = bytes / 4 / 16;
    let head_dim: u64 = if m.is_multiple_of(128) { 128 } else { 64 };
    let r = m / head_dim;
    let heads = std::iter::once(8)
        .chain(1..=1024)
        .find(|&h| r.is_multiple_of(h) && r / h <= 1024)
        .ok_or_else(|| anyhow!("no layout has {} blocks", Bytes(bytes)))?;
    let layers = r / heads;
    let layout = KvLayout::new(
        u32::try_from(layers)?,
        u32::try_from(heads)?,
        head_dim as u32,
        Dtype::Bf16,
        16,
    )
    .with_context(|| format!("layout for {} blocks", Bytes(bytes)))?;
    if layout.block_bytes() != bytes {
        bail!(
            "layout for {} blocks has {}-byte blocks",
            Bytes(bytes),
            layout.block_bytes()
        );
    }
    Ok(layout)
}

/// The directory to run in: `--dir` (created if missing), else ./kvtier-data/bench, else
/// $TMPDIR. Fails if it is not writable.
pub fn base_dir(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = arg {
        std::fs::create_dir_all(d)
            .with_context(|| format!("--dir {} cannot be created", d.display()))?;
        util::check_writable(d).context("--dir")?;
        return Ok(d.to_owned());
    }
    let local = PathBuf::from("kvtier-data/bench");
    if std::fs::create_dir_all(&local).is_ok() && util::check_writable(&local).is_ok() {
        return Ok(local);
    }
    let tmp = std::env::temp_dir();
    util::check_writable(&tmp).context("no --dir given and $TMPDIR")?;
    Ok(tmp)
}

/// Runs one phase with the progress bar showing what it is.
pub fn step<T>(bar: &ProgressBar, what: String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    bar.set_message(what);
    let r = f();
    bar.inc(1);
    r
}

/// The NVMe references: pwrite, then pread (O_DIRECT where the file system allows), on
/// `threads` threads, each cycling over its own `per` blocks of a file in `dir`, which is
/// filled first (untimed) and removed afterwards. Returns (write, read, whether O_DIRECT).
pub fn direct_io_reference(
    dir: &Path,
    block: u64,
    nt: usize,
    per: u64,
    budget: &Budget<'_>,
    seed: u64,
    bar: &ProgressBar,
) -> Result<(Phase, Phase, bool)> {
    let bs = usize::try_from(block)?;
    let sz = Bytes(block);
    let slot_of = |t: usize, i: u64| t as u64 * per + i % per;
    let raw_path = dir.join(format!("raw-{block}-{nt}.dat"));
    let raw_len = nt as u64 * per * block;
    let (raw, raw_direct) = open_raw(&raw_path, raw_len)?;
    let raw_write = |buf: &mut AlignedBuf, t: usize, i: u64| -> Result<bool> {
        let off = slot_of(t, i) * block;
        raw.write_all_at(buf, off)
            .with_context(|| format!("pwrite at {off} in {}", raw_path.display()))?;
        Ok(true)
    };
    let src = |t: usize| Ok(util::random_buf(bs, sub_seed(seed, 500 + t as u64)));
    step(bar, format!("{sz}: filling the reference file"), || {
        phase(nt, &Budget::Fixed(per), src, raw_write)
    })?;
    let raw_w = step(bar, format!("{sz}: O_DIRECT pwrite x{nt}"), || {
        phase(nt, budget, src, raw_write)
    })?;
    let raw_r = step(bar, format!("{sz}: O_DIRECT pread x{nt}"), || {
        phase(
            nt,
            budget,
            |_| Ok(AlignedBuf::new(bs)),
            |buf, t, i| {
                let off = slot_of(t, i) * block;
                raw.read_exact_at(buf, off)
                    .with_context(|| format!("pread at {off} in {}", raw_path.display()))?;
                Ok(true)
            },
        )
    })?;
    drop(raw);
    std::fs::remove_file(&raw_path).with_context(|| format!("removing {}", raw_path.display()))?;
    Ok((raw_w, raw_r, raw_direct))
}

/// Creates `path` with `len` bytes allocated, opened with O_DIRECT where the file system
/// allows it (else buffered, and says so).
fn open_raw(path: &Path, len: u64) -> Result<(File, bool)> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(flags)
            .open(path)
    };
    let (f, direct) = match open(libc::O_DIRECT) {
        Ok(f) => (f, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!(
                "warning: {} refuses O_DIRECT; the reference uses buffered I/O",
                path.display()
            );
            (
                open(0).with_context(|| format!("creating {}", path.display()))?,
                false,
            )
        }
        Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
    };
    let l = libc::off_t::try_from(len).context("reference file too large")?;
    // SAFETY: a plain syscall on a descriptor `f` owns and keeps open for the call.
    let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, l) };
    match rc {
        0 => {}
        libc::EOPNOTSUPP | libc::EINVAL => f
            .set_len(len)
            .with_context(|| format!("sizing {}", path.display()))?,
        e => {
            return Err(std::io::Error::from_raw_os_error(e))
                .with_context(|| format!("allocating {} bytes for {}", len, path.display()));
        }
    }
    Ok((f, direct))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_urls() {
        assert_eq!(
            parse_redis_url("redis://127.0.0.1:6379"),
            Ok(RedisUrl::Tcp("127.0.0.1:6379".into()))
        );
        assert_eq!(
            parse_redis_url("tcp://localhost:7000/"),
            Ok(RedisUrl::Tcp("localhost:7000".into()))
        );
        assert_eq!(
            parse_redis_url("unix:///run/redis.sock"),
            Ok(RedisUrl::Unix("/run/redis.sock".into()))
        );
        for bad in [
            "",
            "127.0.0.1:6379",
            "redis://",
            "redis://host",
            "redis://host:0",
            "redis://host:99999",
            "redis://user@host:6379",
            "unix://relative.sock",
            "http://host:80",
        ] {
            let e = parse_redis_url(bad).unwrap_err();
            assert!(e.contains("not a Redis address"), "{bad:?}: {e}");
        }
    }
}
