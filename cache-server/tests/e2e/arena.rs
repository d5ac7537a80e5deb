//! The local path against a hostile local client: the arena and the slot table it is given
//! cannot be written, hole-punched, resized or re-sealed through any route, so another
//! client's blocks stay exact and the server stays up; misuse of its own staging region costs
//! only its own puts.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvtier_client::recv_with_fds;
use kvtier_core::protocol::{
    ErrorCode, HEADER_BYTES, Header, Hello, HelloReply, Limits, PutEntry, Request, Response,
};
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

use crate::common::*;

/// Says hello on the Unix socket asking for the arena, as a client written from
/// `docs/protocol.md` would: the reply's first bytes are read with `recvmsg`, and the
/// descriptors riding with them kept.
pub(crate) async fn local_hello(path: &Path) -> (Raw<UnixStream>, HelloReply, Vec<OwnedFd>) {
    let s = UnixStream::connect(path).await.unwrap();
    let mut raw = Raw::new(s);
    raw.send(
        &Request::Hello(Hello {
            min_version: kvtier_core::protocol::VERSION,
            max_version: kvtier_core::protocol::VERSION,
            client: "hostile".into(),
            token: String::new(),
            block_bytes: 0,
            want_arena: true,
        }),
        &[],
    )
    .await;
    let mut head = [0u8; HEADER_BYTES];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HEADER_BYTES {
        raw.s.readable().await.unwrap();
        match raw.s.try_io(tokio::io::Interest::READABLE, || {
            recv_with_fds(raw.s.as_raw_fd(), &mut head[got..])
        }) {
            Ok((0, _)) => panic!("server closed during hello"),
            Ok((n, f)) => {
                got += n;
                fds.extend(f);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("recvmsg: {e}"),
        }
    }
    let limits = Limits::default();
    let h = Header::decode(&head, &limits).unwrap();
    let mut meta = vec![0u8; h.meta_len as usize];
    raw.s.read_exact(&mut meta).await.unwrap();
    let Response::Hello(hello) = Response::decode(&h, &meta, &limits).unwrap() else {
        panic!("no hello reply");
    };
    (raw, hello, fds)
}

fn punch(f: &File, offset: u64, len: u64) -> i32 {
    // SAFETY: fallocate on a descriptor we own, integer arguments only.
    unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    }
}

/// Asserts that `f` (a descriptor passed at hello, of `bytes` bytes) can be neither written
/// (at `off`), hole-punched, resized nor re-sealed, through the descriptor itself or the
/// memfd reopened read-write through /proc, and that a read-only shared mapping of it works
/// and cannot be made writable. Returns that mapping (the caller unmaps it).
fn assert_read_only(name: &str, f: &File, bytes: u64, off: u64) -> *mut libc::c_void {
    let reopened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .unwrap();
    for (what, f) in [("passed fd", f), ("reopened read-write", &reopened)] {
        assert!(
            memmap2::MmapOptions::new()
                .len(bytes as usize)
                .map_raw(f)
                .is_err(),
            "{name}, {what}: mapped writable"
        );
        assert!(
            f.write_at(&[0xAA; 64], off).is_err(),
            "{name}, {what}: written"
        );
        assert_ne!(punch(f, off, 4096), 0, "{name}, {what}: hole punched");
        assert!(f.set_len(0).is_err(), "{name}, {what}: truncated to 0");
        assert!(f.set_len(bytes * 2).is_err(), "{name}, {what}: grown");
        // SAFETY: fcntl with an integer argument; expected to fail (sealed).
        let seal = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert!(seal < 0, "{name}, {what}: sealed");
    }
    // SAFETY: a fresh shared read-only mapping of the whole file; the caller unmaps it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "{name}: no read-only mapping");
    // SAFETY: the range is the mapping just made.
    let up = unsafe { libc::mprotect(addr, bytes as usize, libc::PROT_READ | libc::PROT_WRITE) };
    assert_ne!(up, 0, "{name}: a read-only mapping was made writable");
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_client_cannot_write_punch_or_resize_the_arena() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let victim = srv.client("unix").await;
        assert!(victim.is_local());
        let ks = keys(b"victim", 8, 0);
        put_all(&victim, &ks).await;

        let (mut raw, hello, fds) = local_hello(&srv.unix).await;
        assert!(
            hello.arena_bytes > 0 && hello.staging_bytes > 0,
            "{hello:?}"
        );
        let [arena, _staging, table]: [OwnedFd; 3] = fds.try_into().expect("three descriptors");
        let arena = File::from(arena);
        // The attacker learns where the victim's first block lives.
        raw.send(
            &Request::Pin {
                keys: ks.clone(),
                lease_ms: 10_000,
            },
            &[],
        )
        .await;
        let Response::Pin(p) = raw.recv().await.unwrap().1 else {
            panic!("pin refused");
        };
        assert_eq!(p.blocks.len(), ks.len());
        let off = p.blocks[0].offset;

        // Every route to writing that slot fails, and so does every route to writing,
        // punching or resizing the published slot table (which says what each slot holds).
        let len = hello.arena_bytes as usize;
        let addr = assert_read_only("arena", &arena, hello.arena_bytes, off);
        assert!(hello.slot_table_bytes > 0, "{hello:?}");
        let table = File::from(table);
        let tmap = assert_read_only("slot table", &table, hello.slot_table_bytes, 0);
        // What it maps is the table the server publishes: its magic, and the victim's blocks
        // still read with no message below.
        // SAFETY: the first 8 bytes of a mapping of at least 4,096; the server only writes
        // the header before any client is given the table.
        let magic = unsafe { std::ptr::read_volatile(tmap as *const u64) };
        assert_eq!(magic, kvtier_core::slot_table::MAGIC);
        // SAFETY: unmapping the mapping made by `assert_read_only`; nothing refers to it.
        unsafe { libc::munmap(tmap, hello.slot_table_bytes as usize) };
        let mut seen = vec![0u8; BLOCK];
        // SAFETY: [off, off + BLOCK) lies in the mapping (the server named it), the slot is
        // pinned, and the copy forms no reference into the shared memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (addr as *const u8).add(off as usize),
                seen.as_mut_ptr(),
                BLOCK,
            )
        };
        assert_eq!(seen, block_data(ks[0]));
        // SAFETY: unmapping the mapping made above; nothing refers to it any more.
        unsafe { libc::munmap(addr, len) };

        // The server is up, and the victim still reads exactly its bytes, in place.
        let before = victim.fast_hits();
        assert_eq!(get_verified(&victim, &ks).await, ks.len());
        assert!(
            victim.fast_hits() > before,
            "no read through the slot table"
        );
        let (code, _) = http_get(srv.admin, "/health").await;
        assert_eq!(code, 200);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misusing_its_staging_region_costs_a_client_only_its_own_puts() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let victim = srv.client("unix").await;
        let theirs = keys(b"bystander", 4, 0);
        put_all(&victim, &theirs).await;

        let (mut raw, hello, fds) = local_hello(&srv.unix).await;
        let [_arena, staging, _table]: [OwnedFd; 3] = fds.try_into().expect("three descriptors");
        let staging = File::from(staging);
        let places = (hello.staging_bytes / BLOCK as u64) as usize;
        assert!(places >= 2, "{hello:?}");
        let map = memmap2::MmapOptions::new()
            .len(hello.staging_bytes as usize)
            .map_raw(&staging)
            .unwrap();
        let mine = keys(b"hostile", 3, 0);
        let reserve = |ks: &[kvtier_core::BlockKey]| Request::Reserve {
            entries: ks
                .iter()
                .enumerate()
                .map(|(i, k)| PutEntry {
                    key: *k,
                    parent: i.checked_sub(1).map(|p| ks[p]),
                })
                .collect(),
            lease_ms: 10_000,
        };

        // A put through the staging region, as the SDK does it, stores exact bytes.
        raw.send(&reserve(&mine[..1]), &[]).await;
        let Response::Reserve(r) = raw.recv().await.unwrap().1 else {
            panic!("reserve refused");
        };
        let data = block_data(mine[0]);
        // SAFETY: the server named this place of our own mapping; nothing else writes it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                map.as_mut_ptr().add(r.slots[0].offset as usize),
                BLOCK,
            )
        };
        raw.send(
            &Request::Commit {
                reservation_id: r.reservation_id,
            },
            &[],
        )
        .await;
        let Response::Commit(c) = raw.recv().await.unwrap().1 else {
            panic!("commit refused");
        };
        assert_eq!(c.statuses, vec![0]);
        assert_eq!(get_verified(&victim, &mine[..1]).await, 1);

        // Its staging region cannot be resized (so the server never faults reading it).
        assert!(staging.set_len(0).is_err(), "truncated");
        assert!(staging.set_len(hello.staging_bytes * 2).is_err(), "grown");
        // SAFETY: fcntl with an integer argument; expected to fail (sealed).
        let seal =
            unsafe { libc::fcntl(staging.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert!(seal < 0, "sealed");

        // Holes punched under a reserved place: the commit stores zeros for its own key.
        raw.send(&reserve(&mine[1..2]), &[]).await;
        let Response::Reserve(r) = raw.recv().await.unwrap().1 else {
            panic!("reserve refused");
        };
        assert_eq!(punch(&staging, 0, hello.staging_bytes), 0);
        raw.send(
            &Request::Commit {
                reservation_id: r.reservation_id,
            },
            &[],
        )
        .await;
        let Response::Commit(c) = raw.recv().await.unwrap().1 else {
            panic!("commit refused");
        };
        assert_eq!(c.statuses, vec![0]);
        let mut buf = vec![1u8; BLOCK];
        let got = victim.get_into(&mine[1..2], &mut [&mut buf[..]]).await;
        assert_eq!(got.blocks, 1);
        assert_eq!(buf, vec![0u8; BLOCK]);

        // More entries than places: refused whole; places all lent: busy.
        let many = keys(b"many", places + 1, 0);
        raw.send(&reserve(&many), &[]).await;
        let (_, resp, _) = raw.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::TooLarge), "{resp:?}");
        raw.send(&reserve(&many[..places]), &[]).await;
        let Response::Reserve(held) = raw.recv().await.unwrap().1 else {
            panic!("reserve refused");
        };
        assert!(held.slots.iter().all(|s| s.status == 0));
        raw.send(&reserve(&mine[2..]), &[]).await;
        let (_, resp, _) = raw.recv().await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::Busy), "{resp:?}");
        raw.send(
            &Request::Abort {
                reservation_id: held.reservation_id,
            },
            &[],
        )
        .await;
        assert!(matches!(raw.recv().await.unwrap().1, Response::Done));
        raw.send(&reserve(&mine[2..]), &[]).await;
        assert!(matches!(
            raw.recv().await.unwrap().1,
            Response::Reserve(r) if r.reservation_id != 0
        ));

        // The server is up and everyone else's blocks are exact.
        assert_eq!(get_verified(&victim, &theirs).await, theirs.len());
        assert_eq!(get_verified(&victim, &mine[..1]).await, 1);
    })
    .await;
}

/// Concurrent puts on one local connection share its one staging region: the SDK runs them
/// one reservation at a time, so none is refused "busy" and every block comes back exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_local_puts_on_one_connection_all_land() {
    let srv = ServerProc::start(&[]);
    bounded(60, async {
        let c = std::sync::Arc::new(srv.client("unix").await);
        assert!(c.is_local());
        let chains: Vec<Vec<kvtier_core::BlockKey>> =
            (0..8).map(|i| keys(b"concurrent", 40, i)).collect();
        let mut tasks = Vec::new();
        for ks in chains.clone() {
            let c = c.clone();
            tasks.push(tokio::spawn(async move { put_all(&c, &ks).await }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for ks in &chains {
            assert_eq!(get_verified(&c, ks).await, ks.len());
        }
    })
    .await;
}
