//! Helpers shared by the benchmarks: size parsing and printing, aligned buffers, a seeded
//! PRNG, a timed loop, and facts about the machine and the benchmark directory.

use std::ffi::CString;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
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

/// Parses a comma-separated list of sizes (`"64k,2m,16m"`); empty items are refused.
pub fn parse_size_list(s: &str) -> Result<Vec<u64>, String> {
    let sizes = s
        .split(',')
        .map(parse_size)
        .collect::<Result<Vec<_>, _>>()?;
    if sizes.is_empty() {
        return Err("no sizes given".into());
    }
    Ok(sizes)
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

/// SplitMix64: a tiny, seeded, reproducible PRNG (not for secrets).
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
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
    fn parses_size_lists() {
        assert_eq!(
            parse_size_list("64k,2m,16m"),
            Ok(vec![64 << 10, 2 << 20, 16 << 20])
        );
        assert!(parse_size_list("64k,,2m").is_err());
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
    fn aligned_buffers_are_aligned() {
        let b = random_buf(65536, 7);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.len(), 65536);
        assert!(b.iter().any(|&x| x != 0));
    }
}
