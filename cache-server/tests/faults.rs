//! A fault-injecting NVMe file under the store: errors, short writes, a full disk and a disk
//! that stops answering. The store degrades to misses, keeps its index consistent, keeps
//! serving from DRAM and never stalls a caller. Each test runs over every tier list with NVMe.

mod common;

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use kvtier_server::tier::nvme::file::SlotFile;
use kvtier_server::{GetOutcome, MissReason, PutOutcome, TierKind, TieredStore};

#[derive(Default)]
struct Faults {
    fail_reads: AtomicBool,
    fail_writes: AtomicBool,
    disk_full: AtomicBool,
    /// Writes transfer at most this many bytes per call (0: unlimited).
    short_writes: AtomicU32,
    /// While set, every I/O waits.
    stalled: Mutex<bool>,
    resume: Condvar,
}

struct FaultyFile {
    inner: File,
    faults: Arc<Faults>,
}

impl FaultyFile {
    fn wait_if_stalled(&self) {
        let mut g = self.faults.stalled.lock().unwrap();
        while *g {
            g = self.faults.resume.wait(g).unwrap();
        }
    }
}

impl SlotFile for FaultyFile {
    fn read_vectored_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        self.wait_if_stalled();
        if self.faults.fail_reads.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.read_vectored_at(bufs, offset)
    }

    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        self.wait_if_stalled();
        if self.faults.fail_writes.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if self.faults.disk_full.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let limit = self.faults.short_writes.load(Ordering::SeqCst) as usize;
        if limit > 0 {
            // Short write: only the first `limit` bytes of the first buffer (4 KiB aligned, so
            // O_DIRECT accepts it), the caller must loop.
            let first = &bufs[0][..limit.min(bufs[0].len())];
            return self.inner.write_vectored_at(&[IoSlice::new(first)], offset);
        }
        self.inner.write_vectored_at(bufs, offset)
    }
}

/// The tier lists with an NVMe tier (the faults are injected there).
const NVME_LISTS: [Tiers; 2] = [Tiers::DramNvme, Tiers::HbmDramNvme];

fn open(dir: &Path, faults: &Arc<Faults>, tiers: Tiers) -> TieredStore {
    let f = faults.clone();
    let wrap = move |inner: File, _: &Path| -> Arc<dyn SlotFile> {
        Arc::new(FaultyFile {
            inner,
            faults: f.clone(),
        })
    };
    TieredStore::open_with(config_tiers(tiers, 4, (dir, 16), 4), &wrap)
        .unwrap()
        .0
}

fn nvme_stat(s: &TieredStore) -> kvtier_server::TierStats {
    s.stats().tier(TierKind::Nvme).unwrap().clone()
}

#[test]
fn write_errors_and_a_full_disk_leave_dram_serving() {
    for tiers in NVME_LISTS {
        write_errors_and_a_full_disk_leave_dram_serving_on(tiers);
    }
}

fn write_errors_and_a_full_disk_leave_dram_serving_on(tiers: Tiers) {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let s = open(dir.path(), &faults, tiers);
    faults.fail_writes.store(true, Ordering::SeqCst);
    s.put(key(1), None, &data(key(1))).unwrap();
    s.flush();
    faults.fail_writes.store(false, Ordering::SeqCst);
    faults.disk_full.store(true, Ordering::SeqCst);
    s.put(key(2), None, &data(key(2))).unwrap();
    s.flush();
    // Each failed copy counts its write and the failed erase of the slot's old header.
    assert_eq!(nvme_stat(&s).io_errors, 4);
    assert_eq!(
        nvme_stat(&s).used_slots,
        0,
        "failed copies must free their slots"
    );
    for k in [key(1), key(2)] {
        assert_eq!(get(&s, k), GetOutcome::Hit(TierKind::Dram));
    }
    // The disk recovers: copies work again.
    faults.disk_full.store(false, Ordering::SeqCst);
    s.put(key(3), None, &data(key(3))).unwrap();
    s.flush();
    assert_eq!(nvme_stat(&s).used_slots, 1);
    s.check_consistency().unwrap();
}

#[test]
fn short_writes_are_completed() {
    for tiers in NVME_LISTS {
        short_writes_are_completed_on(tiers);
    }
}

fn short_writes_are_completed_on(tiers: Tiers) {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    faults.short_writes.store(4096, Ordering::SeqCst);
    {
        let s = open(dir.path(), &faults, tiers);
        for i in 0..3 {
            s.put(key(i), None, &data(key(i))).unwrap();
        }
        s.flush();
        assert_eq!(nvme_stat(&s).io_errors, 0);
    }
    let s = open(dir.path(), &faults, tiers);
    for i in 0..3 {
        assert_eq!(get(&s, key(i)), GetOutcome::Hit(TierKind::Nvme));
    }
}

#[test]
fn read_errors_are_misses_and_drop_the_entry() {
    for tiers in NVME_LISTS {
        read_errors_are_misses_and_drop_the_entry_on(tiers);
    }
}

fn read_errors_are_misses_and_drop_the_entry_on(tiers: Tiers) {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    {
        let s = open(dir.path(), &faults, tiers);
        for i in 0..3 {
            s.put(key(i), None, &data(key(i))).unwrap();
        }
        s.flush();
    }
    let s = open(dir.path(), &faults, tiers);
    s.put(key(9), None, &data(key(9))).unwrap();
    faults.fail_reads.store(true, Ordering::SeqCst);
    assert_eq!(get(&s, key(0)), GetOutcome::Miss(MissReason::IoError));
    assert!(!s.contains(&key(0)), "index kept a block it cannot read");
    assert_eq!(s.lookup(&[key(1)]), vec![TierKind::Nvme]);
    assert_eq!(get(&s, key(9)), GetOutcome::Hit(TierKind::Dram));
    s.flush();
    assert_eq!(nvme_stat(&s).io_errors, 1);
    assert_eq!(nvme_stat(&s).pins_outstanding, 0);
    s.check_consistency().unwrap();
}

#[test]
fn a_stalled_disk_never_stalls_puts() {
    for tiers in NVME_LISTS {
        a_stalled_disk_never_stalls_puts_on(tiers);
    }
}

fn a_stalled_disk_never_stalls_puts_on(tiers: Tiers) {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let mut c = config_tiers(tiers, 64, (dir.path(), 16), 4);
    c.admission.max_backlog = 8;
    let f = faults.clone();
    let wrap = move |inner: File, _: &Path| -> Arc<dyn SlotFile> {
        Arc::new(FaultyFile {
            inner,
            faults: f.clone(),
        })
    };
    let s = Arc::new(TieredStore::open_with(c, &wrap).unwrap().0);
    *faults.stalled.lock().unwrap() = true;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        let mut outcomes = Vec::new();
        for i in 0..200 {
            outcomes.push(s2.put(key(i), None, &data(key(i))).unwrap());
        }
        done_tx.send(outcomes).unwrap();
    });
    let outcomes = done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("puts stalled behind a stalled disk");
    let stored = outcomes
        .iter()
        .filter(|o| matches!(o, PutOutcome::Stored(_)))
        .count();
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o, PutOutcome::Rejected(_)))
        .count();
    assert!(
        stored > 0 && refused > 0,
        "stored {stored}, refused {refused}"
    );
    let d = s.stats().tier(TierKind::Dram).unwrap().clone();
    assert_eq!(d.admissions_refused as usize, refused);
    *faults.stalled.lock().unwrap() = false;
    faults.resume.notify_all();
    s.flush();
    assert_eq!(s.stats().io_backlog, 0);
    s.check_consistency().unwrap();
}

/// Flips one byte of block `k`'s data wherever it is stored in a file under `dir` (the
/// NVMe slot files); returns how many copies it damaged.
fn corrupt_on_disk(dir: &Path, k: kvtier_core::BlockKey) -> usize {
    let want = data(k);
    let probe = &want[..256];
    let mut hits = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let mut bytes = std::fs::read(&p).unwrap();
            let mut at = 0;
            let mut changed = false;
            while let Some(i) = bytes[at..].windows(probe.len()).position(|w| w == probe) {
                bytes[at + i + 100] ^= 0xff;
                at += i + probe.len();
                hits += 1;
                changed = true;
            }
            if changed {
                std::fs::write(&p, &bytes).unwrap();
            }
        }
    }
    hits
}

#[test]
fn a_corrupt_block_drops_the_rest_of_its_chain() {
    for tiers in NVME_LISTS {
        a_corrupt_block_drops_the_rest_of_its_chain_on(tiers);
    }
}

fn a_corrupt_block_drops_the_rest_of_its_chain_on(tiers: Tiers) {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let keys: Vec<_> = (100..108).map(key).collect();
    let put_chain = |s: &TieredStore| -> Vec<PutOutcome> {
        let out = (0..keys.len())
            .map(|i| {
                let parent = i.checked_sub(1).map(|p| keys[p]);
                let o = s.put(keys[i], parent, &data(keys[i])).unwrap();
                // DRAM (4 blocks) frees a slot once its copy to NVMe is done.
                s.flush();
                o
            })
            .collect();
        s.flush();
        out
    };
    {
        let s = open(dir.path(), &faults, tiers);
        put_chain(&s);
    }
    // Reopened: the chain's first blocks (those DRAM evicted) are on NVMe only. Blocks 1, 2
    // and 3 are damaged there.
    for i in [1, 2, 3] {
        assert_eq!(
            corrupt_on_disk(dir.path(), keys[i]),
            1,
            "{tiers:?} block {i}"
        );
    }
    let s = open(dir.path(), &faults, tiers);
    let on_disk = s.lookup(&keys).len();
    assert!(on_disk >= 4, "{tiers:?}: {on_disk}");
    assert_eq!(s.lookup(&keys), vec![TierKind::Nvme; on_disk], "{tiers:?}");
    // One read of the chain stops at the first corrupt block...
    let r = s.pin_read(&keys);
    assert_eq!(r.blocks().len(), 1, "{tiers:?}");
    assert_eq!(r.miss(), Some(MissReason::Corrupt), "{tiers:?}");
    for (i, _) in r.blocks().iter().enumerate() {
        assert!(r.bytes(i) == data(keys[i]), "{tiers:?} block {i}");
    }
    drop(r);
    // ... and the next lookup reports only the blocks before it, also when asked past it.
    assert_eq!(s.lookup(&keys).len(), 1, "{tiers:?}");
    for (i, k) in keys.iter().enumerate().skip(1) {
        assert!(!s.contains(k), "{tiers:?}: block {i} still indexed");
    }
    // One put of the chain repairs all of it.
    let stored = put_chain(&s);
    assert!(
        stored[1..]
            .iter()
            .all(|o| matches!(o, PutOutcome::Stored(_))),
        "{tiers:?}: {stored:?}"
    );
    assert_eq!(s.lookup(&keys).len(), 8, "{tiers:?}");
    for (i, k) in keys.iter().enumerate() {
        assert!(
            matches!(get(&s, *k), GetOutcome::Hit(_)),
            "{tiers:?} block {i}"
        );
    }
    s.flush();
    assert_eq!(nvme_stat(&s).corrupt_dropped, 1, "{tiers:?}");
    assert_eq!(nvme_stat(&s).pins_outstanding, 0, "{tiers:?}");
    s.check_consistency().unwrap();
}
