//! The conformance suite every transfer backend passes: random descriptor lists verified byte
//! for byte against a model, concurrent posts, notifications after data, cancellation
//! mid-transfer, the peer disappearing mid-transfer, and registering/deregistering/reusing
//! regions. One generic suite, instantiated per backend at the bottom.
//!
//! The mid-transfer tests run on a current-thread runtime: the transfer is polled once by
//! hand (so it has posted, and partly moved, its first chunks), then cancelled or its peer
//! dropped before any other task, the peer's included, gets to run. That makes "mid-transfer"
//! exact without any timing.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use kvtier_core::SplitMix64;
use kvtier_transfer::{
    Agent, AgentConfig, BackendKind, Descriptor, ErrorKind, Op, RegionHandle, Transfer,
};

const REGION_BYTES: u64 = 1 << 20;
const CHUNK_BYTES: u64 = 64 << 10;
const TEST_DEADLINE: Duration = Duration::from_secs(60);

fn config() -> AgentConfig {
    AgentConfig {
        chunk_bytes: CHUNK_BYTES,
        shm_chunk_bytes: CHUNK_BYTES,
        tcp_streams: 4,
        quic_streams: 2,
        ..AgentConfig::default()
    }
}

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_DEADLINE, f)
        .await
        .expect("the test ran past its deadline");
}

/// Deterministic test randomness (the workspace's one PRNG).
struct Rng(SplitMix64);
impl Rng {
    fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn fill(region: &RegionHandle, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let bytes: Vec<u8> = (0..region.len()).map(|_| rng.next() as u8).collect();
    region.write_at(0, &bytes).unwrap();
    bytes
}

fn contents(region: &RegionHandle) -> Vec<u8> {
    let mut v = vec![0u8; region.len() as usize];
    region.read_at(0, &mut v).unwrap();
    v
}

fn poll_once(t: &mut Transfer) -> Poll<<Transfer as Future>::Output> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    Pin::new(t).poll(&mut cx)
}

struct Pair {
    initiator: Agent,
    target: Agent,
    local: Vec<RegionHandle>,
    remote: Vec<RegionHandle>,
    peer: kvtier_transfer::Peer,
}

async fn pair(
    kind: BackendKind,
    cfg: fn() -> AgentConfig,
    regions: usize,
    region_bytes: u64,
) -> Pair {
    let initiator = Agent::new("initiator", cfg()).await.unwrap();
    let target = Agent::new("target", cfg()).await.unwrap();
    let local: Vec<_> = (0..regions)
        .map(|_| initiator.alloc_dram(region_bytes).unwrap())
        .collect();
    let remote: Vec<_> = (0..regions)
        .map(|_| target.alloc_dram(region_bytes).unwrap())
        .collect();
    let peer = initiator
        .connect(&target.metadata().unwrap(), kind)
        .await
        .unwrap();
    assert_eq!(peer.name(), "target");
    assert_eq!(peer.backend(), kind);
    Pair {
        initiator,
        target,
        local,
        remote,
        peer,
    }
}

/// A random descriptor list: up to 24 descriptors, some adjacent (to exercise merging), some
/// spanning several chunks, destinations never overlapping within the list.
fn random_list(rng: &mut Rng, p: &Pair, op: Op) -> Vec<Descriptor> {
    let n = 1 + rng.below(24) as usize;
    let mut out: Vec<Descriptor> = Vec::new();
    let mut dest_used: Vec<(usize, u64, u64)> = Vec::new();
    let mut attempts = 0;
    while out.len() < n && attempts < 200 {
        attempts += 1;
        let len = match rng.below(4) {
            0 => 1 + rng.below(64),
            1 => 1 + rng.below(8 << 10),
            2 => 1 + rng.below(96 << 10),
            _ => 1 + rng.below(300 << 10),
        };
        let (li, lo, ri, ro) = match out.last() {
            Some(prev) if rng.below(3) == 0 => {
                let li = p.local.iter().position(|r| r.id() == prev.local).unwrap();
                let ri = p.remote.iter().position(|r| r.id() == prev.remote).unwrap();
                (
                    li,
                    prev.local_offset + prev.len,
                    ri,
                    prev.remote_offset + prev.len,
                )
            }
            _ => {
                let li = rng.below(p.local.len() as u64) as usize;
                let ri = rng.below(p.remote.len() as u64) as usize;
                (
                    li,
                    rng.below(REGION_BYTES - len + 1),
                    ri,
                    rng.below(REGION_BYTES - len + 1),
                )
            }
        };
        if lo + len > REGION_BYTES || ro + len > REGION_BYTES {
            continue;
        }
        let (di, doff) = if op == Op::Write { (ri, ro) } else { (li, lo) };
        if dest_used
            .iter()
            .any(|&(i, s, l)| i == di && doff < s + l && s < doff + len)
        {
            continue;
        }
        dest_used.push((di, doff, len));
        out.push(Descriptor::new(
            p.local[li].id(),
            lo,
            p.remote[ri].id(),
            ro,
            len,
        ));
    }
    out
}

fn apply(
    model_local: &mut [Vec<u8>],
    model_remote: &mut [Vec<u8>],
    p: &Pair,
    op: Op,
    list: &[Descriptor],
) {
    for d in list {
        let li = p.local.iter().position(|r| r.id() == d.local).unwrap();
        let ri = p.remote.iter().position(|r| r.id() == d.remote).unwrap();
        let (lo, ro, n) = (
            d.local_offset as usize,
            d.remote_offset as usize,
            d.len as usize,
        );
        match op {
            Op::Write => {
                let src = model_local[li][lo..lo + n].to_vec();
                model_remote[ri][ro..ro + n].copy_from_slice(&src);
            }
            Op::Read => {
                let src = model_remote[ri][ro..ro + n].to_vec();
                model_local[li][lo..lo + n].copy_from_slice(&src);
            }
        }
    }
}

pub async fn random_descriptor_lists(kind: BackendKind, cfg: fn() -> AgentConfig) {
    let p = pair(kind, cfg, 2, REGION_BYTES).await;
    let mut ml: Vec<Vec<u8>> = p
        .local
        .iter()
        .enumerate()
        .map(|(i, r)| fill(r, 10 + i as u64))
        .collect();
    let mut mr: Vec<Vec<u8>> = p
        .remote
        .iter()
        .enumerate()
        .map(|(i, r)| fill(r, 20 + i as u64))
        .collect();
    let mut rng = Rng::new(0x5eed_0000 + kind as u64);
    let mut merged_some = false;
    for round in 0..40 {
        let op = if round % 2 == 0 { Op::Write } else { Op::Read };
        let list = random_list(&mut rng, &p, op);
        let expected_bytes: u64 = list.iter().map(|d| d.len).sum();
        let merged = kvtier_transfer::merge_adjacent(&list).len();
        merged_some |= merged < list.len();
        let stats = p.peer.post(op, &list, None).unwrap().await.unwrap();
        assert_eq!(stats.bytes, expected_bytes);
        assert_eq!(stats.descriptors, merged);
        assert_eq!(stats.op, op);
        apply(&mut ml, &mut mr, &p, op, &list);
        for (r, m) in p.local.iter().zip(&ml) {
            assert!(
                contents(r) == *m,
                "{kind} round {round}: local region differs from the model"
            );
        }
        for (r, m) in p.remote.iter().zip(&mr) {
            assert!(
                contents(r) == *m,
                "{kind} round {round}: remote region differs from the model"
            );
        }
    }
    assert!(
        merged_some,
        "the generator never produced adjacent descriptors"
    );
}

pub async fn concurrent_posts_from_many_tasks(kind: BackendKind, cfg: fn() -> AgentConfig) {
    let p = pair(kind, cfg, 1, REGION_BYTES).await;
    let src = fill(&p.local[0], 3);
    let tasks = 16u64;
    let slice = REGION_BYTES / tasks;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let peer = p.peer.clone();
        let (l, r) = (p.local[0].id(), p.remote[0].id());
        handles.push(tokio::spawn(async move {
            // Each task writes its slice in 4 pieces, one transfer each.
            for piece in 0..4 {
                let off = t * slice + piece * slice / 4;
                let d = Descriptor::new(l, off, r, off, slice / 4);
                peer.write(&[d]).unwrap().await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    assert!(
        contents(&p.remote[0]) == src,
        "{kind}: concurrent writes lost bytes"
    );
}

pub async fn notification_follows_data(kind: BackendKind, cfg: fn() -> AgentConfig) {
    let p = pair(kind, cfg, 1, REGION_BYTES).await;
    let src = fill(&p.local[0], 5);
    let d = Descriptor::new(p.local[0].id(), 0, p.remote[0].id(), 0, REGION_BYTES);
    p.peer
        .post(Op::Write, &[d], Some(b"layer 0 done".to_vec()))
        .unwrap()
        .await
        .unwrap();
    let n = p.target.recv_notification().await.unwrap();
    assert_eq!(n.from, "initiator");
    assert_eq!(n.message, b"layer 0 done");
    // The data was in place when the notification arrived.
    assert!(contents(&p.remote[0]) == src);
    // READs can notify too (the peer learns its bytes were taken).
    p.peer
        .post(Op::Read, &[d], Some(b"taken".to_vec()))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        p.target.recv_notification().await.unwrap().message,
        b"taken"
    );
    let too_big = vec![0u8; kvtier_transfer::MAX_NOTIFICATION_BYTES + 1];
    let e = p.peer.post(Op::Write, &[d], Some(too_big)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}

/// Cancels a transfer after its first chunks moved; it reports `Cancelled`, the peer never
/// sees its notification, and the connection keeps working.
pub async fn cancellation_mid_transfer(kind: BackendKind, cfg: fn() -> AgentConfig) {
    for op in [Op::Write, Op::Read] {
        let p = pair(kind, cfg, 1, 8 << 20).await;
        fill(&p.local[0], 7);
        fill(&p.remote[0], 8);
        let big = Descriptor::new(p.local[0].id(), 0, p.remote[0].id(), 0, 8 << 20);
        let mut t = p
            .peer
            .post(op, &[big], Some(b"cancelled".to_vec()))
            .unwrap();
        assert!(
            poll_once(&mut t).is_pending(),
            "{kind}: an 8 MiB transfer finished in one poll"
        );
        let handle = t.cancel_handle();
        handle.cancel();
        let e = t.await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Cancelled, "{kind} {op:?}: {e}");

        // Dropping a half-polled transfer is a cancellation too.
        let mut t = p.peer.post(op, &[big], Some(b"dropped".to_vec())).unwrap();
        assert!(poll_once(&mut t).is_pending());
        drop(t);

        // Chunks a cancelled transfer had already handed to the transport may still land
        // (the documented contract), so the checks below use fresh regions on both sides.
        let src_region = p.initiator.alloc_dram(8 << 20).unwrap();
        let dst_region = p.target.alloc_dram(8 << 20).unwrap();
        let src = fill(&src_region, 17);
        let peer = p
            .initiator
            .connect(&p.target.metadata().unwrap(), kind)
            .await
            .unwrap();
        // The connection still works, and the next notification is the first one seen.
        let small = Descriptor::new(src_region.id(), 0, dst_region.id(), 0, 4096);
        p.peer
            .post(
                Op::Write,
                &[Descriptor::new(
                    p.local[0].id(),
                    0,
                    p.remote[0].id(),
                    0,
                    4096,
                )],
                Some(b"after".to_vec()),
            )
            .unwrap()
            .await
            .unwrap();
        let n = p.target.recv_notification().await.unwrap();
        assert_eq!(
            n.message, b"after",
            "{kind}: a cancelled transfer's notification arrived"
        );
        assert!(p.target.try_recv_notification().is_none());
        // And full transfers after the cancellations move every byte.
        peer.write(&[small]).unwrap().await.unwrap();
        assert!(contents(&dst_region)[..4096] == src[..4096]);
        let all = Descriptor::new(src_region.id(), 0, dst_region.id(), 0, 8 << 20);
        peer.write(&[all]).unwrap().await.unwrap();
        assert!(contents(&dst_region) == src);
    }
}

/// The target agent goes away after the first chunks moved: `Disconnected`, never success,
/// also for every later post.
pub async fn peer_disappears_mid_transfer(kind: BackendKind, cfg: fn() -> AgentConfig) {
    for op in [Op::Write, Op::Read] {
        let Pair {
            initiator,
            target,
            local,
            remote,
            peer,
        } = pair(kind, cfg, 1, 8 << 20).await;
        fill(&local[0], 9);
        let big = Descriptor::new(local[0].id(), 0, remote[0].id(), 0, 8 << 20);
        let mut t = peer.post(op, &[big], Some(b"never".to_vec())).unwrap();
        assert!(poll_once(&mut t).is_pending());
        drop(target);
        let e = t.await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Disconnected, "{kind} {op:?}: {e}");
        // Later posts fail the same way (they may pass validation: the blob lists the region).
        let small = Descriptor::new(local[0].id(), 0, remote[0].id(), 0, 4096);
        let e = peer.post(op, &[small], None).unwrap().await.unwrap_err();
        assert_eq!(
            e.kind(),
            ErrorKind::Disconnected,
            "{kind} {op:?} after: {e}"
        );
        drop(remote);
        drop(initiator);
    }
}

/// A local region deregistered while a transfer using it is in flight: the transfer fails with
/// `RegionNotFound` (never success), and the connection keeps working.
pub async fn local_region_deregistered_mid_transfer(kind: BackendKind, cfg: fn() -> AgentConfig) {
    for op in [Op::Write, Op::Read] {
        let Pair {
            initiator,
            target,
            mut local,
            remote,
            peer,
        } = pair(kind, cfg, 1, 8 << 20).await;
        let doomed = local.remove(0);
        let big = Descriptor::new(doomed.id(), 0, remote[0].id(), 0, 8 << 20);
        let mut t = peer.post(op, &[big], Some(b"never".to_vec())).unwrap();
        assert!(poll_once(&mut t).is_pending());
        drop(doomed);
        let e = t.await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RegionNotFound, "{kind} {op:?}: {e}");
        assert!(e.to_string().contains("initiator"), "{e}");
        let fresh = initiator.alloc_dram(4096).unwrap();
        let d = Descriptor::new(fresh.id(), 0, remote[0].id(), 0, 4096);
        peer.post(op, &[d], Some(b"after".to_vec()))
            .unwrap()
            .await
            .unwrap();
        assert_eq!(target.recv_notification().await.unwrap().message, b"after");
    }
}

pub async fn register_deregister_reuse(kind: BackendKind, cfg: fn() -> AgentConfig) {
    let p = pair(kind, cfg, 1, REGION_BYTES).await;
    let src = fill(&p.local[0], 11);

    // A remote region deregistered after the blob was exported: RegionNotFound from the peer.
    let doomed = p.target.alloc_dram(REGION_BYTES).unwrap();
    let peer = p
        .initiator
        .connect(&p.target.metadata().unwrap(), kind)
        .await
        .unwrap();
    let d = Descriptor::new(p.local[0].id(), 0, doomed.id(), 0, 4096);
    peer.write(&[d]).unwrap().await.unwrap();
    let doomed_id = doomed.id();
    drop(doomed);
    for op in [Op::Write, Op::Read] {
        let e = peer.post(op, &[d], None).unwrap().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RegionNotFound, "{kind} {op:?}: {e}");
    }
    // A region the blob never listed: refused at post.
    let e = peer
        .write(&[Descriptor::new(
            p.local[0].id(),
            0,
            kvtier_transfer::RegionId(9999),
            0,
            1,
        )])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RegionNotFound);

    // A local region deregistered: refused at post.
    let gone = p.initiator.alloc_dram(4096).unwrap();
    let gone_id = gone.id();
    drop(gone);
    let e = peer
        .write(&[Descriptor::new(gone_id, 0, p.remote[0].id(), 0, 1)])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RegionNotFound);

    // Reuse: a new region (a new id; ids are never reused), a fresh blob, the same bytes.
    let fresh = p.target.alloc_dram(REGION_BYTES).unwrap();
    assert_ne!(fresh.id(), doomed_id);
    let peer = p
        .initiator
        .connect(&p.target.metadata().unwrap(), kind)
        .await
        .unwrap();
    let d = Descriptor::new(p.local[0].id(), 0, fresh.id(), 0, REGION_BYTES);
    peer.write(&[d]).unwrap().await.unwrap();
    assert!(contents(&fresh) == src);

    // An existing memfd (a server's arena) registered by fd.
    let arena = {
        use std::os::fd::FromRawFd;
        // SAFETY: a valid NUL-terminated name; the returned fd is owned by the OwnedFd below.
        let fd = unsafe {
            libc::memfd_create(
                c"arena".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by nobody else.
        std::fs::File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    };
    arena.set_len(REGION_BYTES).unwrap();
    let arena_view = arena.try_clone().unwrap();
    let arena_region = p.target.register_memfd(arena.into(), REGION_BYTES).unwrap();
    let peer = p
        .initiator
        .connect(&p.target.metadata().unwrap(), kind)
        .await
        .unwrap();
    peer.write(&[Descriptor::new(
        p.local[0].id(),
        0,
        arena_region.id(),
        0,
        REGION_BYTES,
    )])
    .unwrap()
    .await
    .unwrap();
    let mut seen = vec![0u8; REGION_BYTES as usize];
    std::os::unix::fs::FileExt::read_exact_at(&arena_view, &mut seen, 0).unwrap();
    assert!(
        seen == src,
        "{kind}: the arena's own fd does not see the write"
    );
    // Registration sealed its size: nobody can cut pages off under a peer's mapping.
    assert!(arena_view.set_len(4096).is_err());

    // A memfd that cannot be sealed: fine over the network, refused over shared memory.
    let unsealable = {
        use std::os::fd::FromRawFd;
        // SAFETY: as above.
        let fd = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: as above.
        std::fs::File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    };
    unsealable.set_len(4096).unwrap();
    let plain = p.target.register_memfd(unsealable.into(), 4096).unwrap();
    let peer = p
        .initiator
        .connect(&p.target.metadata().unwrap(), kind)
        .await
        .unwrap();
    let result = peer
        .write(&[Descriptor::new(p.local[0].id(), 0, plain.id(), 0, 4096)])
        .unwrap()
        .await;
    if kind == BackendKind::Shm {
        let e = result.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BackendUnavailable, "{e}");
        assert!(e.to_string().contains("sealed"), "{e}");
    } else {
        result.unwrap();
        assert!(contents(&plain) == src[..4096]);
    }

    // Files and memfds are regions too.
    let dir = tempfile::tempdir().unwrap();
    let file = p
        .target
        .register_file(&dir.path().join("region"), REGION_BYTES)
        .unwrap();
    assert_eq!(file.kind(), kvtier_transfer::MemKind::File);
    let peer = p
        .initiator
        .connect(&p.target.metadata().unwrap(), kind)
        .await
        .unwrap();
    peer.write(&[Descriptor::new(
        p.local[0].id(),
        0,
        file.id(),
        0,
        REGION_BYTES,
    )])
    .unwrap()
    .await
    .unwrap();
    assert!(contents(&file) == src);
    assert!(std::fs::read(dir.path().join("region")).unwrap() == src);
}

pub async fn invalid_descriptors(kind: BackendKind, cfg: fn() -> AgentConfig) {
    let p = pair(kind, cfg, 1, REGION_BYTES).await;
    let (l, r) = (p.local[0].id(), p.remote[0].id());
    let check = |descs: Vec<Descriptor>, kind_expected: ErrorKind| {
        let e = p.peer.write(&descs).unwrap_err();
        assert_eq!(e.kind(), kind_expected, "{descs:?}: {e}");
    };
    check(vec![], ErrorKind::InvalidDescriptor);
    check(
        vec![Descriptor::new(l, 0, r, 0, 0)],
        ErrorKind::InvalidDescriptor,
    );
    check(
        vec![Descriptor::new(l, REGION_BYTES, r, 0, 1)],
        ErrorKind::InvalidDescriptor,
    );
    check(
        vec![Descriptor::new(l, 0, r, REGION_BYTES - 1, 2)],
        ErrorKind::InvalidDescriptor,
    );
    check(
        vec![Descriptor::new(l, u64::MAX, r, 0, 2)],
        ErrorKind::InvalidDescriptor,
    );
    check(
        vec![
            Descriptor::new(l, 0, r, 0, 8),
            Descriptor::new(l, 0, r, u64::MAX - 1, 8),
        ],
        ErrorKind::InvalidDescriptor,
    );
    let e = p
        .peer
        .write(&[
            Descriptor::new(l, 0, r, 0, 8),
            Descriptor::new(l, 0, r, REGION_BYTES, 8),
        ])
        .unwrap_err();
    assert!(e.to_string().contains("descriptor 1"), "{e}");
}

/// A region its agent made read-only to peers: a peer's WRITE into it fails with a clear
/// error and leaves its bytes as they were; READs of it, and the agent's own READs into a
/// read-only region of its own, still work. (TCP and QUIC enforce it; see
/// `RegionHandle::refuse_remote_writes`.)
async fn read_only_regions_refuse_peer_writes(kind: BackendKind) {
    let p = pair(kind, config, 1, REGION_BYTES).await;
    let (l, r) = (p.local[0].id(), p.remote[0].id());
    let before = fill(&p.remote[0], 7);
    fill(&p.local[0], 8);
    p.remote[0].refuse_remote_writes();
    p.local[0].refuse_remote_writes();
    let e = p
        .peer
        .write(&[Descriptor::new(l, 0, r, 4096, 2 * CHUNK_BYTES)])
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidDescriptor, "{e}");
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(contents(&p.remote[0]), before);
    // Reads of it land in the initiator's own region, read-only to *its* peers.
    p.peer
        .read(&[Descriptor::new(l, 0, r, 0, REGION_BYTES)])
        .unwrap()
        .await
        .unwrap();
    assert_eq!(contents(&p.local[0]), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_read_only_regions_refuse_peer_writes() {
    bounded(read_only_regions_refuse_peer_writes(BackendKind::Tcp)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_read_only_regions_refuse_peer_writes() {
    bounded(read_only_regions_refuse_peer_writes(BackendKind::Quic)).await
}

/// A blob published without its token connects only with the agent's token given by other
/// means; foreign memory registered with an owner stays valid while the region needs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_without_its_token_needs_the_token() {
    bounded(async {
        let token = [7u8; kvtier_transfer::TOKEN_BYTES];
        // A fixed port (one free a moment ago), as a firewall rule would want.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let target = Agent::new(
            "target",
            AgentConfig {
                token: Some(token),
                shm: false,
                // Without UCX (on by default in a `ucx` build), which needs region addresses.
                ucx: false,
                listen_port: port,
                ..config()
            },
        )
        .await
        .unwrap();
        assert_eq!(target.listen_addr(BackendKind::Tcp).unwrap().port(), port);
        assert_eq!(target.listen_addr(BackendKind::Quic).unwrap().port(), port);
        let initiator = Agent::new("initiator", config()).await.unwrap();
        let owned = std::sync::Arc::new(std::sync::Mutex::new(vec![5u8; 4096]));
        let ptr = owned.lock().unwrap().as_mut_ptr();
        // SAFETY: the Vec's buffer is valid for 4,096 bytes while `owned` lives (never resized);
        // the region keeps a clone of the Arc.
        let remote = unsafe { target.register_raw_owned(ptr, 4096, owned.clone()) }.unwrap();
        drop(owned);
        let blob = target.metadata_without_token().unwrap();
        // Neither the token nor the region's address is in it.
        let contains = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        assert!(!contains(&blob, &token));
        assert!(!contains(&blob, &(ptr as u64).to_le_bytes()));
        assert!(contains(
            &target.metadata().unwrap(),
            &(ptr as u64).to_le_bytes()
        ));
        let local = initiator.alloc_dram(4096).unwrap();
        let Err(e) = initiator.connect(&blob, BackendKind::Tcp).await else {
            panic!("a zero token is accepted");
        };
        assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
        let peer = initiator
            .connect_with_token(&blob, BackendKind::Tcp, token)
            .await
            .unwrap();
        peer.read(&[Descriptor::new(local.id(), 0, remote.id(), 0, 4096)])
            .unwrap()
            .await
            .unwrap();
        assert_eq!(contents(&local), vec![5u8; 4096]);
    })
    .await
}

/// Instantiates the suite for one backend.
macro_rules! conformance {
    ($name:ident, $kind:expr, $cfg:expr) => {
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn random_descriptor_lists_byte_for_byte() {
                bounded(super::random_descriptor_lists($kind, $cfg)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_posts() {
                bounded(super::concurrent_posts_from_many_tasks($kind, $cfg)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn notification() {
                bounded(super::notification_follows_data($kind, $cfg)).await
            }

            #[tokio::test(flavor = "current_thread")]
            async fn cancellation() {
                bounded(super::cancellation_mid_transfer($kind, $cfg)).await
            }

            #[tokio::test(flavor = "current_thread")]
            async fn peer_disappears() {
                bounded(super::peer_disappears_mid_transfer($kind, $cfg)).await
            }

            #[tokio::test(flavor = "current_thread")]
            async fn local_region_deregistered() {
                bounded(super::local_region_deregistered_mid_transfer($kind, $cfg)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn registration() {
                bounded(super::register_deregister_reuse($kind, $cfg)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn descriptors() {
                bounded(super::invalid_descriptors($kind, $cfg)).await
            }
        }
    };
}

conformance!(shm, BackendKind::Shm, config);
conformance!(tcp, BackendKind::Tcp, config);
conformance!(quic, BackendKind::Quic, config);

#[cfg(feature = "ucx")]
fn ucx_tcp_config() -> AgentConfig {
    AgentConfig {
        ucx_transports: Some("tcp".into()),
        ..config()
    }
}

#[cfg(feature = "ucx")]
fn ucx_shm_config() -> AgentConfig {
    AgentConfig {
        ucx_transports: Some("sm,self".into()),
        ..config()
    }
}

// UCX over its TCP transport, and over its shared-memory transports.
#[cfg(feature = "ucx")]
conformance!(ucx_tcp, BackendKind::Ucx, ucx_tcp_config);
#[cfg(feature = "ucx")]
conformance!(ucx_shm, BackendKind::Ucx, ucx_shm_config);

/// CUDA (feature `cuda`). The sentinel runs everywhere: with a GPU it checks the device count,
/// without one it checks that every GPU entry point refuses cleanly (no panic). The others run
/// where a GPU exists and print a "no GPU" skip message elsewhere.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn gpu_or_skip(test: &str) -> bool {
        match kvtier_transfer::cuda_probe() {
            Ok(_) => true,
            Err(e) => {
                // .ci/gpu-check on a GPU machine: a skip there is a failure.
                assert!(
                    std::env::var_os("KVTIER_REQUIRE_GPU").is_none(),
                    "KVTIER_REQUIRE_GPU is set but {e}"
                );
                eprintln!("no GPU: skipping cuda::{test} ({e})");
                false
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sentinel_probe_is_clean() {
        bounded(async {
            let a = Agent::new("a", config()).await.unwrap();
            match kvtier_transfer::cuda_probe() {
                Ok(n) => {
                    assert!(n > 0);
                    let g = a.alloc_gpu(0, 4096).unwrap();
                    assert_eq!(g.kind(), kvtier_transfer::MemKind::Gpu);
                }
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::BackendUnavailable, "{e}");
                    assert!(e.to_string().contains("no GPU") || e.to_string().contains("CUDA"));
                    let e = a.alloc_gpu(0, 4096).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::BackendUnavailable);
                    let e = a.alloc_pinned(4096).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::BackendUnavailable);
                    let b = Agent::new("b", config()).await.unwrap();
                    let e = a
                        .connect(&b.metadata().unwrap(), BackendKind::Cuda)
                        .await
                        .unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::BackendUnavailable);
                    eprintln!("no GPU: CUDA conformance tests skip ({e})");
                }
            }
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn host_device_and_device_device_byte_for_byte() {
        if !gpu_or_skip("host_device_and_device_device_byte_for_byte") {
            return;
        }
        bounded(async {
            let a = Agent::new("a", config()).await.unwrap();
            let b = Agent::new("b", config()).await.unwrap();
            let pinned = a.alloc_pinned(REGION_BYTES).unwrap();
            let pageable = a.alloc_dram(REGION_BYTES).unwrap();
            let gpu_a = a.alloc_gpu(0, REGION_BYTES).unwrap();
            let gpu_b = b.alloc_gpu(0, REGION_BYTES).unwrap();
            let to_b = a
                .connect(&b.metadata().unwrap(), BackendKind::Cuda)
                .await
                .unwrap();
            let to_a = a
                .connect(&a.metadata().unwrap(), BackendKind::Cuda)
                .await
                .unwrap();
            let src = fill(&pinned, 31);
            let mut model = vec![0u8; REGION_BYTES as usize];
            let mut rng = Rng::new(77);
            // Random host->device writes, then the whole device region read back.
            for _ in 0..32 {
                let len = 1 + rng.below(200 << 10);
                let lo = rng.below(REGION_BYTES - len + 1);
                let ro = rng.below(REGION_BYTES - len + 1);
                to_b.write(&[Descriptor::new(pinned.id(), lo, gpu_b.id(), ro, len)])
                    .unwrap()
                    .await
                    .unwrap();
                model[ro as usize..(ro + len) as usize]
                    .copy_from_slice(&src[lo as usize..(lo + len) as usize]);
            }
            let all = Descriptor::new(pageable.id(), 0, gpu_b.id(), 0, REGION_BYTES);
            to_b.read(&[all]).unwrap().await.unwrap();
            assert!(contents(&pageable) == model, "host->device->host differs");
            // Device to device: gpu_b -> gpu_a (a READ from b into a's GPU), then back to host.
            to_b.read(&[Descriptor::new(gpu_a.id(), 0, gpu_b.id(), 0, REGION_BYTES)])
                .unwrap()
                .await
                .unwrap();
            let back = a.alloc_dram(REGION_BYTES).unwrap();
            to_a.read(&[Descriptor::new(back.id(), 0, gpu_a.id(), 0, REGION_BYTES)])
                .unwrap()
                .await
                .unwrap();
            assert!(contents(&back) == model, "device->device differs");
            // Notification after the data.
            to_b.post(
                Op::Write,
                &[Descriptor::new(pinned.id(), 0, gpu_b.id(), 0, 4096)],
                Some(b"gpu".to_vec()),
            )
            .unwrap()
            .await
            .unwrap();
            assert_eq!(b.recv_notification().await.unwrap().message, b"gpu");
            // Deregistered target region, then a vanished target.
            let gpu_b_id = gpu_b.id();
            drop(gpu_b);
            let e = to_b
                .write(&[Descriptor::new(pinned.id(), 0, gpu_b_id, 0, 4096)])
                .unwrap()
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::RegionNotFound, "{e}");
            drop(b);
            let e = to_b
                .write(&[Descriptor::new(pinned.id(), 0, gpu_b_id, 0, 4096)])
                .unwrap()
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Disconnected, "{e}");
        })
        .await
    }

    #[tokio::test(flavor = "current_thread")]
    async fn cancellation_before_the_copy() {
        if !gpu_or_skip("cancellation_before_the_copy") {
            return;
        }
        bounded(async {
            let a = Agent::new("a", config()).await.unwrap();
            let b = Agent::new("b", config()).await.unwrap();
            let host = a.alloc_pinned(REGION_BYTES).unwrap();
            let gpu = b.alloc_gpu(0, REGION_BYTES).unwrap();
            let peer = a
                .connect(&b.metadata().unwrap(), BackendKind::Cuda)
                .await
                .unwrap();
            let t = peer
                .post(
                    Op::Write,
                    &[Descriptor::new(host.id(), 0, gpu.id(), 0, REGION_BYTES)],
                    Some(b"never".to_vec()),
                )
                .unwrap();
            t.cancel();
            assert_eq!(t.await.unwrap_err().kind(), ErrorKind::Cancelled);
            assert!(b.try_recv_notification().is_none());
        })
        .await
    }
}
