//! `kvtier-bench tiers`: DRAM tier put/get against memcpy, and NVMe tier write/read against
//! plain O_DIRECT pwrite/pread, for each block size, in one run.
//!
//! * DRAM: the store is opened without an NVMe tier, so puts and gets touch only the DRAM
//!   arena and the index. Puts use fresh keys (eviction, once the arena is full, is part of
//!   the cost); gets read a pre-filled set round-robin. The reference copies one block-sized
//!   buffer into another, for the same time, on the same number of threads.
//! * NVMe: both sides first fill their whole working set (untimed), so measured writes are
//!   overwrites, as in a full cache, and reads never hit unwritten extents. The reference runs
//!   first, for the given time, on a file of `slots x block` bytes (block `i` at `i x block`);
//!   then the tier does exactly as many operations per thread (same total bytes, same slot
//!   sequence). Each thread owns an equal share of the slots and cycles through it.

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::hint::black_box;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use kvtier_core::{BlockKey, Dtype, KvLayout};
use kvtier_server::tier::{NvmeTierConfig, SlotId, Tier, TierKind};
use kvtier_server::{GetOutcome, PutOutcome, StoreConfig, TieredStore};
use serde::Serialize;

use crate::util::{self, ALIGN, AlignedBuf, Bytes, parse_size, parse_size_list};

/// NVMe slot header bytes (the tier's on-disk format puts one before every payload).
const HEADER_BYTES: u64 = 4096;
const DEFAULT_NVME_MAX: u64 = 2 << 30;
const DEFAULT_DRAM_MAX: u64 = 1 << 30;
const MAX_WARMUP: Duration = Duration::from_millis(500);

/// A comma-separated list of block sizes.
#[derive(Clone, Debug)]
pub struct SizeList(pub Vec<u64>);

fn parse_sizes(s: &str) -> Result<SizeList, String> {
    parse_size_list(s).map(SizeList)
}

#[derive(Args, Debug)]
pub struct TiersArgs {
    /// Directory for the NVMe files (a temporary directory is made inside it and removed
    /// afterwards). Must be on a real disk, not tmpfs. Default: ./kvtier-data/bench, else
    /// $TMPDIR.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Block sizes (binary units, multiples of 4 KiB).
    #[arg(long, default_value = "64k,2m,16m", value_parser = parse_sizes)]
    pub sizes: SizeList,
    /// Measured time of each case (warm-up comes on top).
    #[arg(long, default_value_t = 2.0)]
    pub seconds_per_case: f64,
    /// Threads for the NVMe cases (tier and pread/pwrite alike).
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Threads for the DRAM cases (store and memcpy alike).
    #[arg(long, default_value_t = 1)]
    pub dram_threads: usize,
    /// DRAM tier capacity. Default: 1 GiB, or a quarter of available memory if less.
    #[arg(long, value_parser = parse_size)]
    pub dram_bytes: Option<u64>,
    /// NVMe working set (tier capacity, and size of the reference file). Default: 2 GiB, or a
    /// quarter of the free space if less.
    #[arg(long, value_parser = parse_size)]
    pub nvme_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct TiersReport {
    pub dir: String,
    pub fs_type: String,
    pub free_bytes: u64,
    pub seconds_per_case: f64,
    pub nvme_threads: usize,
    pub dram_threads: usize,
    pub dram_bytes: u64,
    pub nvme_bytes: u64,
    pub sizes: Vec<SizeResult>,
    pub total_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct SizeResult {
    pub block_bytes: u64,
    pub layout: String,
    pub dram: DramInfo,
    pub nvme: NvmeInfo,
    pub cases: Vec<CaseResult>,
}

#[derive(Debug, Serialize)]
pub struct DramInfo {
    pub capacity_bytes: u64,
    pub slots: u32,
    /// Puts refused by the store (not counted as throughput).
    pub put_rejected: u64,
    /// Evictions the puts caused.
    pub put_evictions: u64,
    /// Blocks stored before the get case.
    pub get_prefilled: u64,
    /// Gets not served from DRAM (not counted as throughput).
    pub get_misses: u64,
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
pub struct CaseResult {
    pub case: &'static str,
    pub reference: &'static str,
    pub threads: usize,
    pub tier: Throughput,
    pub reference_result: Throughput,
    /// tier GB/s over reference GB/s.
    pub ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct Throughput {
    pub ops: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gb_per_sec: f64,
    pub ops_per_sec: f64,
}

impl Throughput {
    fn of(p: &Phase, block: u64) -> Self {
        let ops: u64 = p.ops.iter().sum::<u64>() - p.bad;
        let secs = p.wall.as_secs_f64();
        let bytes = ops * block;
        Self {
            ops,
            bytes,
            seconds: secs,
            gb_per_sec: bytes as f64 / secs / 1e9,
            ops_per_sec: ops as f64 / secs,
        }
    }
}

fn case(
    case: &'static str,
    reference: &'static str,
    threads: usize,
    tier: Throughput,
    r: Throughput,
) -> CaseResult {
    let ratio = if r.gb_per_sec > 0.0 {
        tier.gb_per_sec / r.gb_per_sec
    } else {
        f64::NAN
    };
    CaseResult {
        case,
        reference,
        threads,
        tier,
        reference_result: r,
        ratio,
    }
}

/// What one multi-threaded phase did.
struct Phase {
    /// Warm-up operations per thread.
    warm: Vec<u64>,
    /// Measured operations per thread.
    ops: Vec<u64>,
    /// Measured operations that did not do the work (rejected puts, missed gets).
    bad: u64,
    /// Longest measured time of any thread.
    wall: Duration,
}

enum Budget<'a> {
    /// Warm up for `warm`, then measure for `run`.
    Time { warm: Duration, run: Duration },
    /// Repeat another phase's per-thread warm-up and measured operation counts.
    Match(&'a Phase),
    /// No warm-up; exactly this many operations per thread.
    Fixed(u64),
}

/// Runs `op(state, thread, i)` on `threads` threads, each with its own `make(thread)` state;
/// `i` counts on from the warm-up into the measured part. `op` returns false for an operation
/// that did not do its work. Threads start measuring together.
fn phase<S, M, F>(threads: usize, budget: &Budget<'_>, make: M, op: F) -> Result<Phase>
where
    M: Fn(usize) -> Result<S> + Sync,
    F: Fn(&mut S, usize, u64) -> Result<bool> + Sync,
{
    let barrier = Barrier::new(threads);
    let results: Vec<Result<(u64, u64, u64, Duration)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, make, op) = (&barrier, &make, &op);
                s.spawn(move || -> Result<(u64, u64, u64, Duration)> {
                    let bad = Cell::new(0u64);
                    let step = |st: &mut S, i: u64| -> Result<()> {
                        if !op(st, t, i)? {
                            bad.set(bad.get() + 1);
                        }
                        Ok(())
                    };
                    // Every thread must reach the barrier, even after an error.
                    let warmed = make(t).and_then(|mut st| {
                        let w = match budget {
                            Budget::Time { warm, .. } => {
                                util::run_for(*warm, |i| step(&mut st, i))?.0
                            }
                            Budget::Match(p) => {
                                let w = p.warm[t];
                                util::run_n(w, |i| step(&mut st, i))?;
                                w
                            }
                            Budget::Fixed(_) => 0,
                        };
                        Ok((st, w))
                    });
                    barrier.wait();
                    let (mut st, w) = warmed?;
                    bad.set(0);
                    let (n, el) = match budget {
                        Budget::Time { run, .. } => util::run_for(*run, |i| step(&mut st, w + i))?,
                        Budget::Match(p) => {
                            let n = p.ops[t];
                            (n, util::run_n(n, |i| step(&mut st, w + i))?)
                        }
                        Budget::Fixed(n) => (*n, util::run_n(*n, |i| step(&mut st, w + i))?),
                    };
                    Ok((w, n, bad.get(), el))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a benchmark thread panicked")))
            })
            .collect()
    });
    let mut p = Phase {
        warm: Vec::with_capacity(threads),
        ops: Vec::with_capacity(threads),
        bad: 0,
        wall: Duration::ZERO,
    };
    for r in results {
        let (w, n, bad, el) = r?;
        p.warm.push(w);
        p.ops.push(n);
        p.bad += bad;
        p.wall = p.wall.max(el);
    }
    Ok(p)
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

fn describe(l: &KvLayout) -> String {
    format!(
        "{} layers x {} kv heads x {} dim x {} tokens, bf16",
        l.num_layers(),
        l.num_kv_heads(),
        l.head_dim(),
        l.block_tokens()
    )
}

/// The directory to run in: `--dir` (created if missing), else ./kvtier-data/bench, else
/// $TMPDIR. Fails if it is not writable.
fn base_dir(arg: Option<&Path>) -> Result<PathBuf> {
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

fn progress(msg: std::fmt::Arguments<'_>) {
    eprintln!("[kvtier-bench] {msg}");
}

pub fn run(args: &TiersArgs) -> Result<TiersReport> {
    let t0 = Instant::now();
    if !(args.seconds_per_case.is_finite() && args.seconds_per_case > 0.0) {
        bail!("--seconds-per-case must be a positive number of seconds");
    }
    if args.threads == 0 || args.dram_threads == 0 {
        bail!("--threads and --dram-threads must be at least 1");
    }
    for &s in &args.sizes.0 {
        if s == 0 || s % ALIGN as u64 != 0 {
            bail!("--sizes: {s} is not a non-zero multiple of 4096 (the NVMe tier's slot unit)");
        }
    }
    let run_time = Duration::from_secs_f64(args.seconds_per_case);
    let budget = Budget::Time {
        warm: MAX_WARMUP.min(run_time / 4),
        run: run_time,
    };

    let base = base_dir(args.dir.as_deref())?;
    let work = tempfile::Builder::new()
        .prefix("kvtier-bench-")
        .tempdir_in(&base)
        .with_context(|| format!("{} is not writable", base.display()))?;
    let dir = work.path().to_owned();
    let fs_type = util::fs_type(&dir)?;
    let free = util::free_bytes(&dir)?;
    if util::is_memory_fs(&fs_type) {
        eprintln!(
            "warning: {} is on {fs_type}: the NVMe figures measure memory, not a disk",
            dir.display()
        );
    }

    let max_block = args.sizes.0.iter().copied().max().unwrap_or(ALIGN as u64);
    let dram_bytes = match args.dram_bytes {
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
    let nvme_bytes = args
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
    for &block in &args.sizes.0 {
        sizes.push(
            bench_size(args, &budget, &dir, block, dram_bytes, nvme_bytes)
                .with_context(|| format!("{} blocks", Bytes(block)))?,
        );
    }
    let dir_shown = dir.display().to_string();
    work.close()
        .with_context(|| format!("removing {dir_shown}"))?;
    Ok(TiersReport {
        dir: dir_shown,
        fs_type,
        free_bytes: free,
        seconds_per_case: args.seconds_per_case,
        nvme_threads: args.threads,
        dram_threads: args.dram_threads,
        dram_bytes,
        nvme_bytes,
        sizes,
        total_seconds: t0.elapsed().as_secs_f64(),
    })
}

fn bench_size(
    args: &TiersArgs,
    budget: &Budget<'_>,
    dir: &Path,
    block: u64,
    dram_bytes: u64,
    nvme_bytes: u64,
) -> Result<SizeResult> {
    let layout = layout_for(block)?;
    let bs = usize::try_from(block)?;
    let mut cases = Vec::new();

    // ---- DRAM ----
    let dt = args.dram_threads;
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
    let region_setup = |t: usize, seed: u64| -> Result<(AlignedBuf, AlignedBuf)> {
        let region = util::random_buf(bs * region_blocks as usize, seed + t as u64);
        Ok((region, util::random_buf(bs, seed + 50 + t as u64)))
    };
    progress(format_args!("{}: memcpy get/put x{dt}", Bytes(block)));
    let memcpy_get = phase(
        dt,
        budget,
        |t| region_setup(t, 300),
        |(region, buf), _, i| {
            let j = (i % region_blocks) as usize;
            buf.copy_from_slice(&region[j * bs..(j + 1) * bs]);
            black_box(buf.as_ptr());
            Ok(true)
        },
    )?;
    let memcpy_put = phase(
        dt,
        budget,
        |t| region_setup(t, 400),
        |(region, buf), _, i| {
            let j = (i % region_blocks) as usize;
            region[j * bs..(j + 1) * bs].copy_from_slice(buf);
            black_box(region.as_ptr());
            Ok(true)
        },
    )?;

    // Gets first: their pre-fill writes every slot once, so the puts that follow do not
    // pay the arena's first-touch page faults (a long-running server has paid them).
    let prefill = u64::from(slots);
    {
        let src = util::random_buf(bs, 200);
        for i in 0..prefill {
            match store.put(BlockKey::from_u128(u128::from(i) + 1), None, &src)? {
                PutOutcome::Stored(_) => {}
                other => bail!("pre-filling block {i} of {prefill}: {other:?}"),
            }
        }
    }
    progress(format_args!("{}: dram get x{dt}", Bytes(block)));
    let per_thread = |t: usize| (prefill - t as u64).div_ceil(dt as u64);
    let get = phase(
        dt,
        budget,
        |_| Ok(AlignedBuf::new(bs)),
        |buf, t, i| {
            let j = t as u64 + (i % per_thread(t)) * dt as u64;
            let key = BlockKey::from_u128(u128::from(j) + 1);
            Ok(matches!(
                store.get(&key, buf)?,
                GetOutcome::Hit(TierKind::Dram)
            ))
        },
    )?;
    store.clear().context("clearing the store")?;
    progress(format_args!("{}: dram put x{dt}", Bytes(block)));
    let put = phase(
        dt,
        budget,
        |t| Ok(util::random_buf(bs, 100 + t as u64)),
        |src, t, i| {
            let key = BlockKey::from_u128((1u128 << 100) | ((t as u128) << 64) | u128::from(i));
            match store.put(key, None, src)? {
                PutOutcome::Stored(_) => Ok(true),
                PutOutcome::Rejected(_) => Ok(false),
                PutOutcome::AlreadyPresent => bail!("put of a fresh key {key} found it present"),
            }
        },
    )?;
    let put_evictions = store
        .stats()
        .tier(TierKind::Dram)
        .map_or(0, |s| s.evictions);

    drop(store);
    let dram = DramInfo {
        capacity_bytes: dram_bytes,
        slots,
        put_rejected: put.bad,
        put_evictions,
        get_prefilled: prefill,
        get_misses: get.bad,
    };
    cases.push(case(
        "dram put",
        "memcpy",
        dt,
        Throughput::of(&put, block),
        Throughput::of(&memcpy_put, block),
    ));
    cases.push(case(
        "dram get",
        "memcpy",
        dt,
        Throughput::of(&get, block),
        Throughput::of(&memcpy_get, block),
    ));

    // ---- NVMe ----
    let nt = args.threads;
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
    let key_of = |slot: u64| BlockKey::from_u128(u128::from(slot) + 1);

    let raw_path = dir.join(format!("raw-{block}.dat"));
    let raw_len = nt as u64 * per * block;
    let (raw, raw_direct) = open_raw(&raw_path, raw_len)?;
    let raw_write = |buf: &mut AlignedBuf, t: usize, i: u64| -> Result<bool> {
        let off = slot_of(t, i) * block;
        raw.write_all_at(buf, off)
            .with_context(|| format!("pwrite at {off} in {}", raw_path.display()))?;
        Ok(true)
    };
    let src = |t: usize| Ok(util::random_buf(bs, 300 + t as u64));
    progress(format_args!("{}: filling the reference file", Bytes(block)));
    phase(nt, &Budget::Fixed(per), src, raw_write)?;
    progress(format_args!("{}: pwrite x{nt}", Bytes(block)));
    let raw_w = phase(nt, budget, src, raw_write)?;
    progress(format_args!("{}: pread x{nt}", Bytes(block)));
    let raw_r = phase(
        nt,
        budget,
        |_| Ok(AlignedBuf::new(bs)),
        |buf, t, i| {
            let off = slot_of(t, i) * block;
            raw.read_exact_at(buf, off)
                .with_context(|| format!("pread at {off} in {}", raw_path.display()))?;
            Ok(true)
        },
    )?;
    drop(raw);
    std::fs::remove_file(&raw_path).with_context(|| format!("removing {}", raw_path.display()))?;

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
    progress(format_args!("{}: filling the NVMe tier", Bytes(block)));
    phase(nt, &Budget::Fixed(per), src, tier_write)?;
    progress(format_args!("{}: nvme tier write x{nt}", Bytes(block)));
    let tier_w = phase(nt, &Budget::Match(&raw_w), src, tier_write)?;
    progress(format_args!("{}: nvme tier read x{nt}", Bytes(block)));
    let tier_r = phase(
        nt,
        &Budget::Match(&raw_r),
        |_| Ok(AlignedBuf::new(bs)),
        |buf, t, i| {
            let slot = slot_of(t, i);
            tier.read(SlotId(u32::try_from(slot)?), key_of(slot), buf)
                .with_context(|| format!("tier read of slot {slot}"))?;
            Ok(true)
        },
    )?;
    drop(tier);
    std::fs::remove_dir_all(&tier_dir)
        .with_context(|| format!("removing {}", tier_dir.display()))?;

    cases.push(case(
        "nvme write",
        "pwrite",
        nt,
        Throughput::of(&tier_w, block),
        Throughput::of(&raw_w, block),
    ));
    cases.push(case(
        "nvme read",
        "pread",
        nt,
        Throughput::of(&tier_r, block),
        Throughput::of(&raw_r, block),
    ));

    Ok(SizeResult {
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
        cases,
    })
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

fn gb(t: &Throughput) -> String {
    format!("{:.2}", t.gb_per_sec)
}

fn ops(t: &Throughput) -> String {
    if t.ops_per_sec >= 100.0 {
        format!("{:.0}", t.ops_per_sec)
    } else {
        format!("{:.2}", t.ops_per_sec)
    }
}

pub fn print(r: &TiersReport) {
    println!(
        "dir: {} (fs {}, {} free)",
        r.dir,
        r.fs_type,
        Bytes(r.free_bytes)
    );
    println!(
        "seconds per case: {}  threads: dram {} / nvme {}  dram tier: {}  nvme working set: {}",
        r.seconds_per_case,
        r.dram_threads,
        r.nvme_threads,
        Bytes(r.dram_bytes),
        Bytes(r.nvme_bytes)
    );
    for s in &r.sizes {
        println!();
        println!("== block {} ({}) ==", Bytes(s.block_bytes), s.layout);
        println!(
            "dram: {} slots; puts rejected {}, evictions during puts {}; gets over {} blocks, misses {}",
            s.dram.slots,
            s.dram.put_rejected,
            s.dram.put_evictions,
            s.dram.get_prefilled,
            s.dram.get_misses
        );
        println!(
            "nvme: {} slots of 4 KiB header + {} = {} of tier files, {} used (pre-filled); reference file {}; O_DIRECT: tier {} (report.direct_io), reference {}",
            s.nvme.slots,
            Bytes(s.block_bytes),
            Bytes(s.nvme.working_set_bytes),
            s.nvme.used_slots,
            Bytes(s.nvme.reference_file_bytes),
            s.nvme.tier_direct_io,
            s.nvme.raw_direct_io
        );
        println!(
            "{:<11} {:>3}  {:>9} {:>10}  {:<8} {:>9} {:>10}  {:>8}",
            "case", "thr", "tier GB/s", "tier ops/s", "ref", "ref GB/s", "ref ops/s", "tier/ref"
        );
        for c in &s.cases {
            println!(
                "{:<11} {:>3}  {:>9} {:>10}  {:<8} {:>9} {:>10}  {:>8.2}",
                c.case,
                c.threads,
                gb(&c.tier),
                ops(&c.tier),
                c.reference,
                gb(&c.reference_result),
                ops(&c.reference_result),
                c.ratio
            );
        }
    }
    println!();
    println!("total time: {:.1} s", r.total_seconds);
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn phases_count_operations() {
        let p = phase(
            2,
            &Budget::Time {
                warm: Duration::from_millis(5),
                run: Duration::from_millis(20),
            },
            |_| Ok(()),
            |_, _, i| Ok(i % 2 == 0),
        )
        .unwrap();
        assert_eq!(p.ops.len(), 2);
        assert!(p.ops.iter().all(|&n| n > 0));
        let q = phase(2, &Budget::Match(&p), |_| Ok(()), |_, _, _| Ok(true)).unwrap();
        assert_eq!(q.ops, p.ops);
        assert_eq!(q.warm, p.warm);
        assert_eq!(q.bad, 0);
    }
}
