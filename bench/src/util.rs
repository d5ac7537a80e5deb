//! Helpers shared by the benchmarks: size parsing and printing, aligned buffers, a seeded
//! PRNG, timed loops (single and multi-threaded) with latency histograms, the figures they
//! produce and the ratio between two of them, and facts about the machine and the benchmark
//! directory.

use std::cell::Cell;
use std::ffi::CString;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use hdrhistogram::Histogram;
use kvtier_core::SplitMix64;
use serde::Serialize;

/// Direct I/O alignment (buffers, offsets and lengths).
pub const ALIGN: usize = 4096;

/// Parses a byte count: a whole number with an optional binary suffix `k`, `m`, `g` or `t`
/// (case-insensitive, optionally followed by `b` or `ib`, a space allowed before it): `"64k"`
/// is 65,536 and `"2MiB"` is 2,097,152. Decimal (SI) units are not accepted, to keep `64k`
/// meaning one thing. The same syntax as the server's configuration.
pub fn parse_size(s: &str) -> Result<u64, String> {
    // One size syntax for the whole project: the server's configuration parser.
    match kvtier_server::server::parse_size(s)? {
        kvtier_server::server::Size::Bytes(b) => Ok(b),
        kvtier_server::server::Size::Auto => Err(format!("{s:?}: \"auto\" is not a size here")),
    }
}

/// Prints a byte count in binary units when it is exact (`64 KiB`), else in bytes.
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut u = 0;
        while u + 1 < UNITS.len() && self.0 >= 1u64 << (10 * (u + 1)) {
            u += 1;
        }
        let unit = 1u64 << (10 * u);
        if self.0.is_multiple_of(unit) {
            write!(f, "{} {}", self.0 / unit, UNITS[u])
        } else {
            write!(f, "{:.2} {}", self.0 as f64 / unit as f64, UNITS[u])
        }
    }
}

/// A zeroed heap buffer aligned to [`ALIGN`] (the store's own, as O_DIRECT wants).
pub use kvtier_server::tier::nvme::file::AlignedBuf;

/// An aligned buffer of `len` bytes (rounded up to 4 KiB) of pseudo-random bytes from `seed`.
pub fn random_buf(len: usize, seed: u64) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    let mut rng = SplitMix64::new(seed);
    for chunk in b.chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    b
}

/// Calls `op(i)` for i = 0, 1, 2, ... until `dur` has passed (at least once); returns how many
/// calls were made and the time they took. Stops early on the first error.
pub fn run_for<F>(dur: Duration, mut op: F) -> Result<(u64, Duration)>
where
    F: FnMut(u64) -> Result<()>,
{
    let start = Instant::now();
    let mut n = 0u64;
    loop {
        op(n)?;
        n += 1;
        let el = start.elapsed();
        if el >= dur {
            return Ok((n, el));
        }
    }
}

/// Calls `op(i)` for i in 0..n; returns the time taken. Stops early on the first error.
pub fn run_n<F>(n: u64, mut op: F) -> Result<Duration>
where
    F: FnMut(u64) -> Result<()>,
{
    let start = Instant::now();
    for i in 0..n {
        op(i)?;
    }
    Ok(start.elapsed())
}

/// Latency of individual operations: an HDR histogram of nanoseconds (3 significant digits,
/// 1 ns to 1 hour; longer operations are recorded as 1 hour).
#[derive(Clone, Debug)]
pub struct Latency(Histogram<u64>);

const LATENCY_MAX_NS: u64 = 3_600_000_000_000;

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

impl Latency {
    pub fn new() -> Self {
        // The bounds are constants that hdrhistogram accepts (low >= 1, high >= 2 * low,
        // 3 significant digits); a failure here is a programming error caught by the tests.
        Self(
            Histogram::new_with_bounds(1, LATENCY_MAX_NS, 3)
                .expect("constant histogram bounds are valid"),
        )
    }

    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.0.saturating_record(ns.clamp(1, LATENCY_MAX_NS));
    }

    /// Adds another histogram's samples (another thread's, another client's).
    pub fn add(&mut self, other: &Latency) {
        // Same bounds on both sides, so adding cannot fail; saturate if it ever did.
        if self.0.add(&other.0).is_err() {
            for v in other.0.iter_recorded() {
                self.0
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }

    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The `q` quantile (0..=1) in microseconds; NaN when nothing was recorded.
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            f64::NAN
        } else {
            self.0.value_at_quantile(q) as f64 / 1e3
        }
    }

    pub fn max_us(&self) -> f64 {
        if self.0.is_empty() {
            f64::NAN
        } else {
            self.0.max() as f64 / 1e3
        }
    }
}

/// What a timed case did: operations that did their work, bytes they moved, the time, and
/// per-operation latency.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    pub ops: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gb_per_s: f64,
    pub ops_per_s: f64,
    pub latency_us_p50: f64,
    pub latency_us_p99: f64,
    pub latency_us_max: f64,
}

impl Figure {
    /// `ops` operations of `bytes_per_op` bytes in `wall`; latency from `lat`.
    pub fn new(ops: u64, bytes_per_op: u64, wall: Duration, lat: &Latency) -> Self {
        let secs = wall.as_secs_f64();
        let bytes = ops.saturating_mul(bytes_per_op);
        let per_s = |v: f64| if secs > 0.0 { v / secs } else { f64::NAN };
        Self {
            ops,
            bytes,
            seconds: secs,
            gb_per_s: per_s(bytes as f64) / 1e9,
            ops_per_s: per_s(ops as f64),
            latency_us_p50: lat.quantile_us(0.5),
            latency_us_p99: lat.quantile_us(0.99),
            latency_us_max: lat.max_us(),
        }
    }
}

/// `subject / reference`, or None when the reference is not a positive finite number (a
/// reference that was not measured, or measured nothing) or the subject is not finite.
pub fn ratio(subject: f64, reference: f64) -> Option<f64> {
    (subject.is_finite() && reference.is_finite() && reference > 0.0).then(|| subject / reference)
}

/// Formats an optional ratio as `0.93x`, or `-` when absent.
pub fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

/// Formats a float with `digits` decimals, or `-` when it is not finite.
pub fn fmt_f(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "-".into()
    }
}

/// What one multi-threaded phase did.
pub struct Phase {
    /// Warm-up operations per thread.
    pub warm: Vec<u64>,
    /// Measured operations per thread.
    pub ops: Vec<u64>,
    /// Measured operations that did not do the work (rejected puts, missed gets).
    pub bad: u64,
    /// Longest measured time of any thread.
    pub wall: Duration,
    /// Latency of the measured operations, all threads together.
    pub latency: Latency,
}

impl Phase {
    /// The phase's figure for operations of `bytes_per_op` bytes (failed operations left out).
    pub fn figure(&self, bytes_per_op: u64) -> Figure {
        let ops = self.ops.iter().sum::<u64>().saturating_sub(self.bad);
        Figure::new(ops, bytes_per_op, self.wall, &self.latency)
    }
}

pub enum Budget<'a> {
    /// Warm up for `warm`, then measure for `run`.
    Time { warm: Duration, run: Duration },
    /// Repeat another phase's per-thread warm-up and measured operation counts.
    Match(&'a Phase),
    /// No warm-up; exactly this many operations per thread.
    Fixed(u64),
}

/// Runs `op(state, thread, i)` on `threads` threads, each with its own `make(thread)` state;
/// `i` counts on from the warm-up into the measured part. `op` returns false for an operation
/// that did not do its work. Threads start measuring together; each measured operation's
/// latency is recorded.
pub fn phase<S, M, F>(threads: usize, budget: &Budget<'_>, make: M, op: F) -> Result<Phase>
where
    M: Fn(usize) -> Result<S> + Sync,
    F: Fn(&mut S, usize, u64) -> Result<bool> + Sync,
{
    type ThreadResult = Result<(u64, u64, u64, Duration, Latency)>;
    let barrier = Barrier::new(threads);
    let results: Vec<ThreadResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, make, op) = (&barrier, &make, &op);
                s.spawn(move || -> ThreadResult {
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
                            Budget::Time { warm, .. } => run_for(*warm, |i| step(&mut st, i))?.0,
                            Budget::Match(p) => {
                                let w = p.warm[t];
                                run_n(w, |i| step(&mut st, i))?;
                                w
                            }
                            Budget::Fixed(_) => 0,
                        };
                        Ok((st, w))
                    });
                    barrier.wait();
                    let (mut st, w) = warmed?;
                    bad.set(0);
                    let mut lat = Latency::new();
                    let mut timed = |i: u64| -> Result<()> {
                        let t0 = Instant::now();
                        step(&mut st, w + i)?;
                        lat.record(t0.elapsed());
                        Ok(())
                    };
                    let (n, el) = match budget {
                        Budget::Time { run, .. } => run_for(*run, &mut timed)?,
                        Budget::Match(p) => {
                            let n = p.ops[t];
                            (n, run_n(n, &mut timed)?)
                        }
                        Budget::Fixed(n) => (*n, run_n(*n, &mut timed)?),
                    };
                    Ok((w, n, bad.get(), el, lat))
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
        latency: Latency::new(),
    };
    for r in results {
        let (w, n, bad, el, lat) = r?;
        p.warm.push(w);
        p.ops.push(n);
        p.bad += bad;
        p.wall = p.wall.max(el);
        p.latency.add(&lat);
    }
    Ok(p)
}

/// Mixes `seed` with a stream number: independent, reproducible sub-seeds.
pub fn sub_seed(seed: u64, stream: u64) -> u64 {
    let mut r = SplitMix64::new(seed ^ stream.wrapping_mul(0xd134_2543_de82_ef95));
    r.next_u64()
}

/// What the benchmark ran on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub nproc: usize,
    pub kernel: String,
    pub mem_available_bytes: Option<u64>,
}

impl Machine {
    pub fn probe() -> Self {
        let kernel = std::fs::read_to_string("/proc/version")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_else(|| "unknown".into());
        Self {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel,
            mem_available_bytes: mem_available(),
        }
    }
}

impl fmt::Display for Machine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "machine: nproc={} kernel: {}", self.nproc, self.kernel)
    }
}

/// The peak resident set (`VmHWM` in /proc/PID/status) of process `pid` (`"self"` for this
/// one), in bytes.
pub fn peak_rss_bytes(pid: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} contains a NUL byte", path.display()))
}

/// The file system type of `path` (statfs), by name where known, else its magic number.
pub fn fs_type(path: &Path) -> Result<String> {
    let c = c_path(path)?;
    // SAFETY: all-zero bytes are a valid `statfs` (plain integers).
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable statfs.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statfs {}", path.display()));
    }
    // f_type's integer type differs between targets; compare as u64.
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as u64 & 0xffff_ffff;
    let name = match magic {
        0xef53 => "ext2/ext3",
        0x5846_5342 => "xfs",
        0x9123_683e => "btrfs",
        0x0102_1994 => "tmpfs",
        0x8584_58f6 => "ramfs",
        0x794c_7630 => "overlayfs",
        0x6969 => "nfs",
        0x2fc1_2fc1 => "zfs",
        0xf2f5_2010 => "f2fs",
        0x6573_5546 => "fuse",
        0x0102_1997 => "9p",
        0x5346_544e => "ntfs",
        0x4d44 => "vfat",
        _ => return Ok(format!("unknown (magic {magic:#x})")),
    };
    Ok(name.into())
}

/// Bytes available to an unprivileged user on the file system of `path` (statvfs).
pub fn free_bytes(path: &Path) -> Result<u64> {
    let c = c_path(path)?;
    // SAFETY: all-zero bytes are a valid `statvfs` (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", path.display()));
    }
    #[allow(clippy::unnecessary_cast)]
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Whether `fs` (as named by [`fs_type`]) lives in memory rather than on a disk.
pub fn is_memory_fs(fs: &str) -> bool {
    matches!(fs, "tmpfs" | "ramfs")
}

/// Fails unless `dir` is a directory we can create files in.
pub fn check_writable(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    let probe = tempfile::tempfile_in(dir);
    if let Err(e) = probe {
        bail!("{} is not writable: {e}", dir.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("2m"), Ok(2 << 20));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("4KB"), Ok(4096));
        assert_eq!(parse_size(" 4096 "), Ok(4096));
        assert_eq!(parse_size("64 KiB"), Ok(64 << 10));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn refuses_bad_sizes() {
        for bad in ["", "k", "-1", "1.5m", "12x", "auto", "99999999999999t"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn reads_this_process_peak_rss() {
        let rss = peak_rss_bytes("self").unwrap();
        assert!(rss > 1 << 20 && rss.is_multiple_of(1024), "{rss}");
        assert_eq!(peak_rss_bytes("0"), None, "no such process");
    }

    #[test]
    fn prints_sizes() {
        assert_eq!(Bytes(65536).to_string(), "64 KiB");
        assert_eq!(Bytes(16 << 20).to_string(), "16 MiB");
        assert_eq!(Bytes(1000).to_string(), "1000 B");
        assert_eq!(Bytes((1 << 30) + 1).to_string(), "1.00 GiB");
        assert_eq!(Bytes(68 << 10).to_string(), "68 KiB");
        assert_eq!(Bytes(2052 << 10).to_string(), "2.00 MiB");
    }

    #[test]
    fn latency_percentiles_count_every_sample() {
        let mut a = Latency::new();
        assert!(a.quantile_us(0.5).is_nan());
        // 1..=100 us on one thread, 1 ms x 100 on another: p50 in the first half, p99 in
        // the second.
        for us in 1..=100u64 {
            a.record(Duration::from_micros(us));
        }
        let mut b = Latency::new();
        for _ in 0..100 {
            b.record(Duration::from_millis(1));
        }
        assert!(
            (a.quantile_us(0.5) - 50.0).abs() < 0.1,
            "{}",
            a.quantile_us(0.5)
        );
        assert!((a.quantile_us(0.99) - 99.0).abs() < 0.1);
        a.add(&b);
        assert_eq!(a.count(), 200);
        assert!((a.quantile_us(0.5) - 100.0).abs() < 0.1);
        assert!((a.quantile_us(0.99) - 1000.0).abs() < 1.0);
        assert!((a.max_us() - 1000.0).abs() < 1.0);
        // Out-of-range samples are clamped, not lost.
        a.record(Duration::ZERO);
        a.record(Duration::from_secs(7200));
        assert_eq!(a.count(), 202);
    }

    #[test]
    fn figures_and_ratios() {
        let mut l = Latency::new();
        l.record(Duration::from_micros(10));
        let f = Figure::new(1000, 1 << 20, Duration::from_millis(500), &l);
        assert_eq!(f.bytes, 1000 << 20);
        assert!((f.gb_per_s - 1000.0 * 1048576.0 / 0.5 / 1e9).abs() < 1e-9);
        assert!((f.ops_per_s - 2000.0).abs() < 1e-9);
        assert_eq!(ratio(4.0, 5.0), Some(0.8));
        assert_eq!(ratio(4.0, 0.0), None);
        assert_eq!(ratio(4.0, f64::NAN), None);
        assert_eq!(ratio(f64::NAN, 2.0), None);
        assert_eq!(ratio(0.0, 2.0), Some(0.0));
        assert_eq!(fmt_ratio(Some(0.834)), "0.83x");
        assert_eq!(fmt_ratio(None), "-");
        assert_eq!(fmt_f(f64::NAN, 2), "-");
        let empty = Figure::new(0, 10, Duration::ZERO, &Latency::new());
        assert!(empty.gb_per_s.is_nan() && empty.latency_us_p50.is_nan());
    }

    #[test]
    fn phases_count_operations_and_latency() {
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
        assert_eq!(p.latency.count(), p.ops.iter().sum::<u64>());
        let q = phase(2, &Budget::Match(&p), |_| Ok(()), |_, _, _| Ok(true)).unwrap();
        assert_eq!(q.ops, p.ops);
        assert_eq!(q.warm, p.warm);
        assert_eq!(q.bad, 0);
        let f = phase(3, &Budget::Fixed(5), |_| Ok(()), |_, t, _| Ok(t != 1)).unwrap();
        assert_eq!((f.ops.iter().sum::<u64>(), f.bad), (15, 5));
        assert_eq!(f.figure(10).ops, 10);
        let err = phase(
            2,
            &Budget::Fixed(3),
            |_| Ok(()),
            |_, t, i| {
                if t == 1 && i == 1 {
                    bail!("boom")
                }
                Ok(true)
            },
        );
        assert!(err.is_err());
    }

    #[test]
    fn sub_seeds_differ() {
        assert_ne!(sub_seed(1, 0), sub_seed(1, 1));
        assert_ne!(sub_seed(1, 0), sub_seed(2, 0));
        assert_eq!(sub_seed(9, 3), sub_seed(9, 3));
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        let b = random_buf(65536, 7);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.len(), 65536);
        assert!(b.iter().any(|&x| x != 0));
    }
}
