//! Feeds the server's request handling: two in-process servers (tiny DRAM tier, every limit
//! small; one with tenants, whose Unix socket clients are the tenant trusted with the arena,
//! and one without, whose local clients are also passed the published slot table) started
//! once, and per input a fresh connection (Unix socket or TCP, to either server, as the input
//! picks) that says hello and then sends a sequence of frames built from the input:
//! requests of every opcode with arbitrary keys, counts, leases, ids and flags (NO_REPLY),
//! payloads whose length lies, and raw or bit-flipped frames.
//!
//! After each input:
//! - the server answers a ping on a fresh connection within a bound;
//! - with tenants, a block another tenant stored before the campaign still reads back byte for
//!   byte (the
//!   fuzzed tenants have quotas far below the tier, so nothing they do may evict or touch it;
//!   only the admin tenant's `clear` may remove it, and then it must be a clean miss);
//! - once the fuzzed connection is closed, no lease or reservation stays open;
//! - nothing panicked, in any task or thread (a panic aborts the process: libFuzzer reports it).
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use kvtier_core::BlockKey;
use kvtier_core::protocol::{
    FrameBody, HEADER_BYTES, Header, Hello, KeyList, Limits, Opcode, PutEntry, Request, Response,
    VERSION, decode_frame, flags,
};
use kvtier_server::server::{ConfigLoader, Server};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// 1 layer x 4 kv heads x 16 dims x f16 x 16 tokens: 4 KiB blocks.
const BLOCK: usize = 4096;
const FUZZ_TOKEN: &str = "fuzz-tenant-token";
const ADMIN_TOKEN: &str = "fuzz-admin-token";
const REF_TOKEN: &str = "fuzz-reference-token";
/// The reference tenant's block, stored once before the campaign.
const REF_KEY: [u8; 16] = *b"reference-block!";
/// How long the server has to answer each check.
const BOUND: Duration = Duration::from_secs(10);
/// Most frames one input sends.
const MAX_OPS: usize = 32;

struct Fixture {
    rt: tokio::runtime::Runtime,
    /// With tenants.
    server: Server,
    /// Without tenants (one tenant, every client an admin, keys as sent).
    plain: Server,
    _dir: tempfile::TempDir,
}

/// The server without tenants' token.
const PLAIN_TOKEN: &str = "fuzz-plain-token";

fn ref_block() -> Vec<u8> {
    (0..BLOCK).map(|i| (i * 7 + 3) as u8).collect()
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        // Any panic, in any thread or task, is a finding: abort so libFuzzer sees it (tokio
        // would otherwise catch a task's panic and carry on).
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            prev(info);
            std::process::abort();
        }));
        let dir = tempfile::tempdir().expect("tempdir");
        let common = |run: &str| -> Vec<String> {
            vec![
                format!(
                    "server.runtime_dir={:?}",
                    dir.path().join(run).display().to_string()
                ),
                "server.tcp=\"127.0.0.1:0\"".into(),
                "server.quic=\"off\"".into(),
                "server.tls=\"off\"".into(),
                "server.admin=\"off\"".into(),
                "store.tiers=[\"dram\"]".into(),
                "store.dram_bytes=\"4MiB\"".into(),
                "store.dram_prefault=false".into(),
                "store.nvme_dir=\"\"".into(),
                "store.io_threads=1".into(),
                "layout.layers=1".into(),
                "layout.kv_heads=4".into(),
                "layout.head_dim=16".into(),
                "layout.dtype=\"f16\"".into(),
                "layout.block_tokens=16".into(),
                "limits.max_keys=64".into(),
                "limits.max_meta_bytes=\"8KiB\"".into(),
                "limits.max_payload_bytes=\"256KiB\"".into(),
                "limits.max_lease_ms=2000".into(),
                "limits.max_inflight_per_connection=8".into(),
                "limits.frame_timeout_ms=1000".into(),
                // Generous: the checks' own hellos must not be cut by a machine that stalls (a
                // campaign under load once lost a checker's hello to a 1 s bound).
                "limits.hello_timeout_ms=5000".into(),
                "limits.drain_timeout_ms=1000".into(),
                // Inputs send wrong tokens on purpose: the loopback peer must not be throttled.
                "limits.auth_failures_burst=1000000".into(),
                "limits.auth_failures_per_minute=1000000".into(),
            ]
        };
        let mut tenants = common("run");
        tenants.extend([
            // The Unix socket's clients are the fuzzed tenant, trusted with the arena (so
            // reserve, commit and arena pins are fuzzed): quota 64 blocks of 1024.
            format!(
                "tenants.fuzz={{token={FUZZ_TOKEN:?}, quota=\"256KiB\", unix=true, \
                 local_arena=true}}"
            ),
            format!("tenants.boss={{token={ADMIN_TOKEN:?}, quota=\"256KiB\", role=\"admin\"}}"),
            format!("tenants.reference={{token={REF_TOKEN:?}}}"),
        ]);
        let mut plain = common("run-plain");
        plain.push(format!("server.token={PLAIN_TOKEN:?}"));
        let config = |sets: &[String]| {
            let mut loader = ConfigLoader::new();
            for s in sets {
                loader = loader.set(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            }
            loader.build().expect("config")
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let server = rt
            .block_on(Server::start(config(&tenants)))
            .expect("server start");
        let plain = rt
            .block_on(Server::start(config(&plain)))
            .expect("server start");
        let f = Fixture {
            rt,
            server,
            plain,
            _dir: dir,
        };
        f.rt.block_on(bounded("storing the reference block", put_reference(&f)));
        f
    })
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(BOUND, f).await {
        Ok(v) => v,
        Err(_) => panic!("invariant: {what} took over {BOUND:?}"),
    }
}

// ---- A minimal client (the SDK would hide what the fuzzer needs to control). ----

fn frame(op: u8, fl: u8, id: u64, meta: &[u8], payload_len: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::request(Opcode::Ping, id, meta.len(), payload_len);
    h.opcode = op;
    h.flags = fl;
    let mut b = h.encode().to_vec();
    b.extend_from_slice(meta);
    b.extend_from_slice(payload);
    b
}

fn request(r: &Request, id: u64, payload: &[u8]) -> Vec<u8> {
    frame(
        r.opcode() as u8,
        0,
        id,
        &r.encode_meta(),
        payload.len() as u64,
        payload,
    )
}

/// Reads one whole frame; `None` at end of stream or on an error.
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Option<(Header, Response, Vec<u8>)> {
    let mut head = [0u8; HEADER_BYTES];
    r.read_exact(&mut head).await.ok()?;
    let meta_len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
    let payload_len = u64::from_le_bytes(head[24..32].try_into().unwrap());
    if payload_len > 64 << 20 || meta_len > 8 << 20 {
        panic!("invariant: the server sent a frame of {meta_len} + {payload_len} bytes");
    }
    let mut buf = head.to_vec();
    buf.resize(HEADER_BYTES + meta_len + payload_len as usize, 0);
    r.read_exact(&mut buf[HEADER_BYTES..]).await.ok()?;
    let limits = Limits {
        max_meta_bytes: 8 << 20,
        max_keys: 1 << 20,
        max_payload_bytes: 64 << 20,
    };
    match decode_frame(&buf, &limits) {
        Ok(((h, FrameBody::Response(resp), payload), _)) => Some((h, resp, payload.to_vec())),
        Ok((_, _)) => panic!("invariant: the server sent a request frame"),
        Err(e) => panic!("invariant: the server sent a frame its own decoder refuses: {e}"),
    }
}

async fn call<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    r: &Request,
    payload: &[u8],
) -> (Response, Vec<u8>) {
    s.write_all(&request(r, 1, payload))
        .await
        .expect("invariant: writing to the server");
    let sent = Instant::now();
    loop {
        let Some((h, resp, payload)) = read_frame(s).await else {
            panic!(
                "invariant: the server closed a healthy connection ({:?} after {:?})",
                sent.elapsed(),
                r.opcode()
            );
        };
        if !h.is(flags::EVENT) {
            return (resp, payload);
        }
    }
}

fn hello(token: &str, block_bytes: u64, want_arena: bool) -> Request {
    Request::Hello(Hello {
        min_version: VERSION,
        max_version: VERSION,
        client: "fuzz".into(),
        token: token.into(),
        block_bytes,
        want_arena,
    })
}

async fn tcp(f: &Fixture) -> tokio::net::TcpStream {
    tcp_to(&f.server).await
}

async fn tcp_to(server: &Server) -> tokio::net::TcpStream {
    let addr = server.endpoints().tcp.expect("tcp endpoint");
    tokio::net::TcpStream::connect(addr)
        .await
        .expect("invariant: the server accepts a TCP connection")
}

/// A connection to `server` with `token`, after its hello.
async fn conn_to(server: &Server, token: &str) -> tokio::net::TcpStream {
    let mut s = tcp_to(server).await;
    match call(&mut s, &hello(token, BLOCK as u64, false), &[]).await {
        (Response::Hello(h), _) => assert_eq!(h.block_bytes, BLOCK as u64),
        (other, _) => panic!("invariant: a checker's hello got {other:?}"),
    }
    s
}

/// A connection of the reference tenant, after its hello.
async fn reference_conn(f: &Fixture) -> tokio::net::TcpStream {
    conn_to(&f.server, REF_TOKEN).await
}

async fn put_reference(f: &Fixture) {
    let mut s = reference_conn(f).await;
    let put = Request::Put(vec![PutEntry {
        key: BlockKey::from_bytes(REF_KEY),
        parent: None,
    }]);
    match call(&mut s, &put, &ref_block()).await {
        (Response::Put(p), _) if p.statuses.len() == 1 && p.statuses[0] <= 1 => {}
        (other, _) => panic!("invariant: storing the reference block got {other:?}"),
    }
}

/// The checks after each input: to the server with tenants, the reference block too; to the
/// one without, a ping and no lease or reservation left.
async fn check(f: &Fixture, plain: bool, cleared: bool) {
    if plain {
        let mut s = conn_to(&f.plain, PLAIN_TOKEN).await;
        match call(&mut s, &Request::Ping, &[]).await {
            (Response::Pong, _) => {}
            (other, _) => panic!("invariant: ping got {other:?}"),
        }
        return nothing_left_open(&mut s).await;
    }
    let mut s = reference_conn(f).await;
    match call(&mut s, &Request::Ping, &[]).await {
        (Response::Pong, _) => {}
        (other, _) => panic!("invariant: ping got {other:?}"),
    }
    let get = Request::Get(KeyList {
        keys: vec![BlockKey::from_bytes(REF_KEY)],
    });
    match call(&mut s, &get, &[]).await {
        (Response::Get { tiers, .. }, payload) if tiers.len() == 1 => {
            assert!(
                payload == ref_block(),
                "invariant: the reference block reads back different bytes"
            );
        }
        (Response::Get { tiers, miss }, _) if tiers.is_empty() && cleared => {
            let _ = miss;
            put_reference(f).await;
        }
        (other, _) => panic!("invariant: the reference block is gone: {other:?}"),
    }
    nothing_left_open(&mut s).await
}

/// Leases and reservations die with their connection (which the caller saw closed).
async fn nothing_left_open(s: &mut tokio::net::TcpStream) {
    let deadline = Instant::now() + BOUND;
    loop {
        let stats = match call(s, &Request::Stats, &[]).await {
            (Response::Stats(text), _) => text,
            (other, _) => panic!("invariant: stats got {other:?}"),
        };
        let v: serde_json::Value = serde_json::from_str(&stats).expect("stats is JSON");
        if v["leases_open"] == 0 && v["reservations_open"] == 0 {
            break;
        }
        if Instant::now() > deadline {
            panic!("invariant: leases or reservations outlive their connection: {stats}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---- What an input describes. ----

#[derive(Arbitrary, Debug)]
enum Transport {
    /// The fuzzed tenant (`unix = true`, `local_arena = true`): every request, reserve/commit
    /// included.
    Unix,
    /// The fuzzed tenant over TCP.
    Tcp,
    /// The admin tenant over TCP (may `clear`).
    TcpAdmin,
    /// TCP with a wrong token (or none).
    TcpWrongToken(String),
    /// The server without tenants, over its Unix socket (arena and slot table passed).
    PlainUnix,
    /// The server without tenants, over TCP.
    PlainTcp,
}

#[derive(Arbitrary, Debug)]
enum HelloKind {
    /// The right block size (or 0), arena on request.
    Good { zero_size: bool, want_arena: bool },
    /// Any fields at all.
    Any {
        min_version: u16,
        max_version: u16,
        client: String,
        block_bytes: u64,
        want_arena: bool,
    },
    /// No hello: straight to the requests.
    None,
}

/// A key: one of a few shared ones (so requests meet each other's blocks), the reference
/// tenant's key (another namespace: must stay invisible), or any.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Key {
    Pool(u8),
    Reference,
    Any([u8; 16]),
}

impl Key {
    fn get(self) -> BlockKey {
        match self {
            Key::Pool(i) => {
                let mut b = [0u8; 16];
                b[0] = i % 8;
                b[15] = 0x5a;
                BlockKey::from_bytes(b)
            }
            Key::Reference => BlockKey::from_bytes(REF_KEY),
            Key::Any(b) => BlockKey::from_bytes(b),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Keys {
    List(Vec<Key>),
    /// A chain of pool keys from `start`, `len` long (bounded to a little over the limit).
    Run {
        start: u8,
        len: u8,
    },
}

impl Keys {
    fn get(&self) -> Vec<BlockKey> {
        match self {
            Keys::List(l) => l.iter().map(|k| k.get()).collect(),
            Keys::Run { start, len } => (0..*len % 72)
                .map(|i| Key::Pool(start.wrapping_add(i)).get())
                .collect(),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Entry {
    key: Key,
    parent: Option<Key>,
}

fn entries(e: &[Entry]) -> Vec<PutEntry> {
    e.iter()
        .map(|e| PutEntry {
            key: e.key.get(),
            parent: e.parent.map(Key::get),
        })
        .collect()
}

/// A lease or reservation id: one the server returned on this connection, or any.
#[derive(Arbitrary, Debug)]
enum Id {
    Recent(u8),
    Any(u64),
}

/// How many payload bytes a put carries against what its header says.
#[derive(Arbitrary, Debug)]
enum Payload {
    /// `entries * BLOCK`, as it should be.
    Exact,
    /// The header says `declared` and `sent` bytes follow (bounded).
    Lie { declared: u64, sent: u16 },
}

#[derive(Arbitrary, Debug)]
enum Op {
    Ping,
    Hello(HelloKind),
    Lookup(Keys),
    Get(Keys),
    Put {
        entries: Vec<Entry>,
        chain: Option<(u8, u8)>,
        payload: Payload,
        fill: u8,
    },
    Prefetch(Keys),
    Pin {
        keys: Keys,
        lease_ms: u64,
    },
    Release(Id),
    Reserve {
        entries: Vec<Entry>,
        lease_ms: u64,
    },
    Commit(Id),
    Abort(Id),
    Remove(Keys),
    Clear,
    Stats,
    Subscribe {
        from_seq: Option<u64>,
        snapshot: bool,
    },
    Retain {
        session: u64,
        keys: Keys,
        return_ms: u64,
        priority: u8,
    },
    /// A header with any fields and any bytes after it.
    RawHeader {
        version: u16,
        opcode: u8,
        flags: u8,
        meta_len: u32,
        payload_len: u64,
        rest: Vec<u8>,
    },
    /// Any bytes.
    Raw(Vec<u8>),
    /// The next request's bytes, with some bytes changed.
    Flip(Vec<(u16, u8)>),
    /// Waits for the replies to what was sent so far (bounded): later ids can name them.
    Sync,
}

#[derive(Arbitrary, Debug)]
struct Step {
    op: Op,
    no_reply: bool,
    request_id: u64,
}

#[derive(Arbitrary, Debug)]
struct Input {
    transport: Transport,
    hello: HelloKind,
    steps: Vec<Step>,
}

/// What the reader task saw.
#[derive(Default)]
struct Seen {
    replies: u64,
    ids: Vec<u64>,
    closed: bool,
}

fn build(op: &Op, ids: &[u64]) -> Option<(Request, Vec<u8>, Option<u64>)> {
    let id = |i: &Id| match i {
        Id::Recent(n) if !ids.is_empty() => ids[ids.len() - 1 - (*n as usize % ids.len())],
        Id::Recent(n) => u64::from(*n),
        Id::Any(v) => *v,
    };
    let kl = |k: &Keys| KeyList { keys: k.get() };
    Some(match op {
        Op::Ping => (Request::Ping, vec![], None),
        Op::Hello(h) => (hello_request(h, FUZZ_TOKEN), vec![], None),
        Op::Lookup(k) => (Request::Lookup(kl(k)), vec![], None),
        Op::Get(k) => (Request::Get(kl(k)), vec![], None),
        Op::Put {
            entries: e,
            chain,
            payload,
            fill,
        } => {
            let mut e = entries(e);
            if let Some((start, len)) = chain {
                let keys = Keys::Run {
                    start: *start,
                    len: *len,
                }
                .get();
                let mut parent = None;
                for k in keys {
                    e.push(PutEntry { key: k, parent });
                    parent = Some(k);
                }
            }
            let (declared, sent) = match payload {
                Payload::Exact => ((e.len() * BLOCK) as u64, e.len() * BLOCK),
                Payload::Lie { declared, sent } => (*declared, *sent as usize),
            };
            // Bounded: the server's own limit is 256 KiB.
            let sent = sent.min(300 << 10);
            (Request::Put(e), vec![*fill; sent], Some(declared))
        }
        Op::Prefetch(k) => (Request::Prefetch(kl(k)), vec![], None),
        Op::Pin { keys, lease_ms } => (
            Request::Pin {
                keys: keys.get(),
                lease_ms: *lease_ms,
            },
            vec![],
            None,
        ),
        Op::Release(i) => (Request::Release { lease_id: id(i) }, vec![], None),
        Op::Reserve {
            entries: e,
            lease_ms,
        } => (
            Request::Reserve {
                entries: entries(e),
                lease_ms: *lease_ms,
            },
            vec![],
            None,
        ),
        Op::Commit(i) => (
            Request::Commit {
                reservation_id: id(i),
            },
            vec![],
            None,
        ),
        Op::Abort(i) => (
            Request::Abort {
                reservation_id: id(i),
            },
            vec![],
            None,
        ),
        Op::Remove(k) => (Request::Remove(kl(k)), vec![], None),
        Op::Clear => (Request::Clear, vec![], None),
        Op::Stats => (Request::Stats, vec![], None),
        Op::Subscribe { from_seq, snapshot } => (
            Request::Subscribe {
                from_seq: *from_seq,
                snapshot: *snapshot,
            },
            vec![],
            None,
        ),
        Op::Retain {
            session,
            keys,
            return_ms,
            priority,
        } => (
            Request::Retain(kvtier_core::protocol::RetainHint {
                session: *session,
                keys: kl(keys).keys,
                return_ms: *return_ms,
                priority: *priority,
            }),
            vec![],
            None,
        ),
        Op::RawHeader { .. } | Op::Raw(_) | Op::Flip(_) | Op::Sync => return None,
    })
}

fn hello_request(h: &HelloKind, token: &str) -> Request {
    match h {
        HelloKind::Good {
            zero_size,
            want_arena,
        } => hello(
            token,
            if *zero_size { 0 } else { BLOCK as u64 },
            *want_arena,
        ),
        HelloKind::Any {
            min_version,
            max_version,
            client,
            block_bytes,
            want_arena,
        } => Request::Hello(Hello {
            min_version: *min_version,
            max_version: *max_version,
            client: client.clone(),
            token: token.into(),
            block_bytes: *block_bytes,
            want_arena: *want_arena,
        }),
        HelloKind::None => hello(token, BLOCK as u64, false),
    }
}

/// Sends the input's frames on `s` while a task reads (and checks) every reply; returns
/// whether an admin `clear` may have been sent.
async fn drive<S>(s: S, input: &Input, token: &str) -> bool
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut r, mut w) = tokio::io::split(s);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let reader = tokio::spawn({
        let seen = seen.clone();
        async move {
            while let Some((h, resp, payload)) = read_frame(&mut r).await {
                let mut st = seen.lock().unwrap();
                if !h.is(flags::EVENT) {
                    st.replies += 1;
                }
                match resp {
                    Response::Pin(p) if p.lease_id != 0 => st.ids.push(p.lease_id),
                    Response::Reserve(p) => st.ids.push(p.reservation_id),
                    Response::Get { tiers, .. } => {
                        assert_eq!(
                            payload.len(),
                            tiers.len() * BLOCK,
                            "invariant: a get's payload is one block per tier"
                        );
                    }
                    _ => {}
                }
            }
            seen.lock().unwrap().closed = true;
        }
    });
    let admin = matches!(input.transport, Transport::TcpAdmin);
    let mut cleared = false;
    let mut expected = 0u64;
    let mut flip: Option<&Vec<(u16, u8)>> = None;
    if !matches!(input.hello, HelloKind::None) {
        let b = request(&hello_request(&input.hello, token), 0, &[]);
        if w.write_all(&b).await.is_err() {
            return cleared;
        }
        expected += 1;
    }
    for step in input.steps.iter().take(MAX_OPS) {
        let bytes = match &step.op {
            Op::Sync => {
                let until = Instant::now() + Duration::from_millis(200);
                loop {
                    {
                        let st = seen.lock().unwrap();
                        if st.closed || st.replies >= expected {
                            break;
                        }
                    }
                    if Instant::now() > until {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                continue;
            }
            Op::Flip(f) => {
                // Any byte changed may make a clear of the admin's request.
                cleared |= admin;
                flip = Some(f);
                continue;
            }
            Op::Raw(b) => {
                cleared |= admin;
                b.clone()
            }
            Op::RawHeader {
                version,
                opcode,
                flags: fl,
                meta_len,
                payload_len,
                rest,
            } => {
                let mut h = Header::request(Opcode::Ping, step.request_id, 0, *payload_len);
                h.version = *version;
                h.opcode = *opcode;
                h.flags = *fl;
                h.meta_len = *meta_len;
                cleared |= admin;
                let mut b = h.encode().to_vec();
                b.extend_from_slice(rest);
                b
            }
            op => {
                let ids = seen.lock().unwrap().ids.clone();
                let (req, payload, declared) = build(op, &ids).expect("a request op");
                cleared |= admin && matches!(req, Request::Clear);
                let fl = if step.no_reply { flags::NO_REPLY } else { 0 };
                if !step.no_reply {
                    expected += 1;
                }
                frame(
                    req.opcode() as u8,
                    fl,
                    step.request_id,
                    &req.encode_meta(),
                    declared.unwrap_or(payload.len() as u64),
                    &payload,
                )
            }
        };
        let mut bytes = bytes;
        if let Some(f) = flip.take() {
            for (at, x) in f {
                if !bytes.is_empty() {
                    let i = *at as usize % bytes.len();
                    bytes[i] ^= x;
                }
            }
        }
        if w.write_all(&bytes).await.is_err() {
            break;
        }
    }
    // End of input: the server must finish and close the connection.
    let _ = w.shutdown().await;
    match tokio::time::timeout(BOUND, reader).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("invariant: reading replies: {e}"),
        Err(_) => panic!("invariant: the server kept the connection open after the client's EOF"),
    }
    cleared
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    f.rt.block_on(async {
        let cleared = match &input.transport {
            Transport::Unix => {
                let path = f.server.endpoints().unix.clone().expect("unix endpoint");
                let s = tokio::net::UnixStream::connect(path)
                    .await
                    .expect("invariant: the server accepts a Unix connection");
                drive(s, &input, "").await
            }
            Transport::Tcp => drive(tcp(f).await, &input, FUZZ_TOKEN).await,
            Transport::TcpAdmin => drive(tcp(f).await, &input, ADMIN_TOKEN).await,
            Transport::TcpWrongToken(t) => {
                let t = if t == FUZZ_TOKEN || t == ADMIN_TOKEN || t == REF_TOKEN {
                    ""
                } else {
                    t.as_str()
                };
                drive(tcp(f).await, &input, t).await
            }
            Transport::PlainUnix => {
                let path = f.plain.endpoints().unix.clone().expect("unix endpoint");
                let s = tokio::net::UnixStream::connect(path)
                    .await
                    .expect("invariant: the server accepts a Unix connection");
                drive(s, &input, "").await
            }
            Transport::PlainTcp => drive(tcp_to(&f.plain).await, &input, PLAIN_TOKEN).await,
        };
        let plain = matches!(input.transport, Transport::PlainUnix | Transport::PlainTcp);
        check(f, plain, cleared).await;
    });
});
