use super::*;
use crate::BlockKey;

fn k(v: u128) -> BlockKey {
    BlockKey::from_u128(v)
}

fn frame(h: Header, meta: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(meta);
    v.extend_from_slice(payload);
    v
}

fn request_frame(r: &Request, payload: &[u8]) -> Vec<u8> {
    let meta = r.encode_meta();
    frame(
        Header::request(r.opcode(), 7, meta.len(), payload.len() as u64),
        &meta,
        payload,
    )
}

fn response_frame(op: Opcode, r: &Response) -> Vec<u8> {
    let (fl, meta) = r.encode_meta();
    let mut h = Header::request(op, 9, meta.len(), 0);
    h.flags = fl;
    frame(h, &meta, &[])
}

#[test]
fn header_golden_bytes() {
    let h = Header {
        version: 3,
        opcode: Opcode::Get as u8,
        flags: flags::RESPONSE,
        request_id: 0x0102_0304_0506_0708,
        meta_len: 0x20,
        payload_len: 0x20_0000,
    };
    let b = h.encode();
    assert_eq!(
        b,
        [
            b'K', b'V', b'T', b'1', // magic
            3, 0, // version
            4, // opcode: get
            1, // flags: response
            8, 7, 6, 5, 4, 3, 2, 1, // request id
            0x20, 0, 0, 0, // meta_len
            0, 0, 0, 0, // reserved
            0, 0, 0x20, 0, 0, 0, 0, 0, // payload_len
        ]
    );
    assert_eq!(Header::decode(&b, &Limits::default()), Ok(h));
}

#[test]
fn metadata_golden_bytes() {
    // A lookup of two keys: u64 count, then 16 raw bytes per key.
    let r = Request::Lookup(KeyList {
        keys: vec![k(1), k(0xff << 120)],
    });
    let mut want = vec![2, 0, 0, 0, 0, 0, 0, 0];
    want.extend_from_slice(&k(1).as_bytes()[..]);
    want.extend_from_slice(&k(0xff << 120).as_bytes()[..]);
    assert_eq!(r.encode_meta(), want);

    // A put entry: key, then Option<parent> as 0/1 then the key.
    let r = Request::Put(vec![
        PutEntry {
            key: k(2),
            parent: None,
        },
        PutEntry {
            key: k(3),
            parent: Some(k(2)),
        },
    ]);
    let m = r.encode_meta();
    assert_eq!(m.len(), 8 + (16 + 1) + (16 + 1 + 16));
    assert_eq!(&m[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(m[8 + 16], 0);
    assert_eq!(m[8 + 17 + 16], 1);

    // An error reply: u16 code, then a u64-prefixed UTF-8 string.
    let (fl, m) = Response::Error(ErrorReply {
        code: ErrorCode::Busy as u16,
        message: "busy".into(),
    })
    .encode_meta();
    assert_eq!(fl, flags::RESPONSE | flags::ERROR);
    assert_eq!(m, [7, 0, 4, 0, 0, 0, 0, 0, 0, 0, b'b', b'u', b's', b'y']);

    // A fetch reply: u64-prefixed tiers, the miss byte, then u64-prefixed u64 sums.
    let (fl, m) = Response::Fetch(FetchReply {
        tiers: vec![1],
        miss: 1,
        sums: vec![0x0102_0304_0506_0708],
    })
    .encode_meta();
    assert_eq!(fl, flags::RESPONSE);
    assert_eq!(
        m,
        [
            1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1
        ]
    );

    // A hello reply, field by field as `docs/protocol.md` lays it out; the namespace key is
    // an `Option` of 32 raw bytes (no length prefix).
    let reply = |namespace_key| HelloReply {
        version: 3,
        server: "kv".into(),
        block_bytes: 4096,
        layout_fingerprint: 0x0102,
        arena_bytes: 1 << 20,
        staging_bytes: 1 << 18,
        max_keys: 65536,
        max_meta_bytes: 1 << 20,
        max_payload_bytes: 1 << 28,
        max_lease_ms: 30_000,
        event_seq: 5,
        slot_table_bytes: 8192,
        namespace_key,
    };
    let mut want = Vec::new();
    want.extend_from_slice(&3u16.to_le_bytes());
    want.extend_from_slice(&2u64.to_le_bytes());
    want.extend_from_slice(b"kv");
    for v in [4096u64, 0x0102, 1 << 20, 1 << 18] {
        want.extend_from_slice(&v.to_le_bytes());
    }
    want.extend_from_slice(&65536u32.to_le_bytes());
    want.extend_from_slice(&(1u32 << 20).to_le_bytes());
    for v in [1u64 << 28, 30_000, 5, 8192] {
        want.extend_from_slice(&v.to_le_bytes());
    }
    let mut none = want.clone();
    none.push(0);
    assert_eq!(
        Response::Hello(reply(None)).encode_meta(),
        (flags::RESPONSE, none)
    );
    want.push(1);
    want.extend_from_slice(&[0xA5; 32]);
    assert_eq!(
        Response::Hello(reply(Some([0xA5; 32]))).encode_meta(),
        (flags::RESPONSE, want.clone())
    );
    // Decoded strictly: a tag other than 0 or 1, a short key, a trailing byte.
    let h = Header {
        version: 3,
        opcode: Opcode::Hello as u8,
        flags: flags::RESPONSE,
        request_id: 0,
        meta_len: want.len() as u32,
        payload_len: 0,
    };
    let limits = Limits::default();
    assert_eq!(
        Response::decode(&h, &want, &limits).unwrap(),
        Response::Hello(reply(Some([0xA5; 32])))
    );
    let tag = want.len() - 33;
    let mut bad = want.clone();
    bad[tag] = 2;
    assert!(Response::decode(&h, &bad, &limits).is_err(), "option tag 2");
    assert!(
        Response::decode(&h, &want[..want.len() - 1], &limits).is_err(),
        "a short key"
    );
    let mut long = want;
    long.push(0);
    assert!(
        Response::decode(&h, &long, &limits).is_err(),
        "a trailing byte"
    );
}

fn all_requests() -> Vec<Request> {
    let keys = vec![k(1), k(2), k(3)];
    let entries = vec![
        PutEntry {
            key: k(1),
            parent: None,
        },
        PutEntry {
            key: k(2),
            parent: Some(k(1)),
        },
    ];
    vec![
        Request::Hello(Hello {
            min_version: 3,
            max_version: 3,
            client: "worker-0".into(),
            token: "secret".into(),
            block_bytes: 2 << 20,
            want_arena: true,
        }),
        Request::Ping,
        Request::Lookup(KeyList { keys: keys.clone() }),
        Request::Get(KeyList { keys: keys.clone() }),
        Request::Fetch(KeyList { keys: keys.clone() }),
        Request::Put(entries.clone()),
        Request::Prefetch(KeyList { keys: keys.clone() }),
        Request::Pin {
            keys: keys.clone(),
            lease_ms: 5000,
        },
        Request::Release { lease_id: 42 },
        Request::Locate {
            keys: keys.clone(),
            lease_ms: 2000,
        },
        Request::Reserve {
            entries,
            lease_ms: 100,
        },
        Request::Commit { reservation_id: 3 },
        Request::Abort { reservation_id: 4 },
        Request::Remove(KeyList { keys }),
        Request::Clear,
        Request::Stats,
        Request::Subscribe {
            from_seq: Some(10),
            snapshot: true,
        },
        Request::Subscribe {
            from_seq: None,
            snapshot: false,
        },
        Request::Retain(RetainHint {
            session: 9,
            keys: vec![k(1), k(2)],
            return_ms: 30_000,
            priority: 2,
        }),
    ]
}

#[test]
fn every_request_round_trips() {
    let limits = Limits::default();
    for r in all_requests() {
        let payload = if r.opcode() == Opcode::Put {
            vec![5u8; 64]
        } else {
            vec![]
        };
        let bytes = request_frame(&r, &payload);
        let ((h, body, p), used) = decode_frame(&bytes, &limits).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(h.opcode(), Some(r.opcode()));
        assert_eq!(body, FrameBody::Request(r.clone()));
        assert_eq!(p, &payload[..]);
    }
}

#[test]
fn every_response_round_trips() {
    let limits = Limits::default();
    let cases = vec![
        (
            Opcode::Hello,
            Response::Hello(HelloReply {
                version: 3,
                server: "kvtier".into(),
                block_bytes: 4096,
                layout_fingerprint: 0xabc,
                arena_bytes: 1 << 30,
                staging_bytes: 1 << 26,
                slot_table_bytes: 1 << 20,
                max_keys: 65536,
                max_meta_bytes: 1 << 20,
                max_payload_bytes: 1 << 28,
                max_lease_ms: 30_000,
                event_seq: 5,
                namespace_key: Some([9; 32]),
            }),
        ),
        (Opcode::Ping, Response::Pong),
        (
            Opcode::Lookup,
            Response::Lookup {
                tiers: vec![1, 1, 2],
                miss: MissCode::NotCached as u8,
                sources: None,
            },
        ),
        (
            Opcode::Lookup,
            Response::Lookup {
                tiers: vec![1, 3, 3, 2, 3],
                miss: MissCode::NotCached as u8,
                sources: Some(vec![
                    BlockSource {
                        start: 1,
                        len: 2,
                        node: "a".into(),
                    },
                    BlockSource {
                        start: 4,
                        len: 1,
                        node: "b".into(),
                    },
                ]),
            },
        ),
        (
            Opcode::Lookup,
            Response::Lookup {
                tiers: vec![1],
                miss: 0,
                sources: Some(vec![]),
            },
        ),
        (
            Opcode::Get,
            Response::Get {
                tiers: vec![2],
                miss: 0,
            },
        ),
        (
            Opcode::Put,
            Response::Put(PutReply {
                statuses: vec![0, 1, 4],
            }),
        ),
        (
            Opcode::Fetch,
            Response::Fetch(FetchReply {
                tiers: vec![1, 2],
                miss: MissCode::NotCached as u8,
                sums: vec![7, u64::MAX],
            }),
        ),
        (
            Opcode::Locate,
            Response::Locate(LocateReply {
                pin: PinReply {
                    lease_id: 3,
                    lease_ms: 2000,
                    blocks: vec![
                        PinnedSlot { offset: 0, tier: 1 },
                        PinnedSlot {
                            offset: 4096,
                            tier: 2,
                        },
                    ],
                    miss: 0,
                },
                sums: vec![u64::MAX, 5],
            }),
        ),
        (Opcode::Prefetch, Response::Prefetch { queued: 3 }),
        (
            Opcode::Pin,
            Response::Pin(PinReply {
                lease_id: 9,
                lease_ms: 1000,
                blocks: vec![PinnedSlot {
                    offset: 8192,
                    tier: 1,
                }],
                miss: 1,
            }),
        ),
        (
            Opcode::Reserve,
            Response::Reserve(ReserveReply {
                reservation_id: 2,
                lease_ms: 10,
                slots: vec![ReservedSlot {
                    status: 0,
                    offset: 4096,
                }],
            }),
        ),
        (Opcode::Release, Response::Done),
        (
            Opcode::Commit,
            Response::Commit(PutReply { statuses: vec![0] }),
        ),
        (Opcode::Remove, Response::Remove { removed: 2 }),
        (Opcode::Stats, Response::Stats("{}".into())),
        (Opcode::Subscribe, Response::Subscribed { next_seq: 77 }),
        (
            Opcode::Retain,
            Response::Retain(RetainReply {
                status: RetainStatus::Accepted as u8,
                blocks: 12,
                hold_ms: 45_000,
            }),
        ),
        (
            Opcode::Subscribe,
            Response::Events(Events {
                gap: Some((3, 9)),
                events: vec![BlockEvent {
                    seq: 9,
                    kind: EventKind::Stored as u8,
                    tier: TierCode::Dram as u8,
                    key: k(5),
                }],
            }),
        ),
        (
            Opcode::Get,
            Response::Error(ErrorReply {
                code: ErrorCode::TooLarge as u16,
                message: "too many keys".into(),
            }),
        ),
    ];
    for (op, r) in cases {
        let bytes = response_frame(op, &r);
        let ((_, body, _), _) = decode_frame(&bytes, &limits).unwrap();
        assert_eq!(body, FrameBody::Response(r));
    }
}

fn check(bytes: &[u8], want: FrameError) {
    let got = decode_frame(bytes, &Limits::default())
        .map(|_| ())
        .unwrap_err();
    assert_eq!(got, want, "{got}");
}

#[test]
fn malformed_frames_get_named_errors() {
    let ping = request_frame(&Request::Ping, &[]);
    let mut b = ping.clone();
    b[0] = b'X';
    check(
        &b,
        FrameError::BadMagic {
            found: u32::from_le_bytes([b'X', b'V', b'T', b'1']),
        },
    );
    let mut b = ping.clone();
    b[4] = 9;
    check(&b, FrameError::BadVersion { found: 9 });
    let mut b = ping.clone();
    b[7] = 0x80;
    check(&b, FrameError::BadFlags { found: 0x80 });
    let mut b = ping.clone();
    b[21] = 1;
    check(&b, FrameError::Reserved);
    let mut b = ping.clone();
    b[16..20].copy_from_slice(&(2u32 << 20).to_le_bytes());
    check(
        &b,
        FrameError::TooLong {
            what: "metadata",
            got: 2 << 20,
            limit: 1 << 20,
        },
    );
    let mut b = ping.clone();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    check(
        &b,
        FrameError::TooLong {
            what: "payload",
            got: u64::MAX,
            limit: 256 << 20,
        },
    );
    check(&ping[..10], FrameError::Truncated { need: 32, have: 10 });
    let get = request_frame(&Request::Get(KeyList { keys: vec![k(1)] }), &[]);
    check(
        &get[..get.len() - 1],
        FrameError::Truncated {
            need: get.len() as u64,
            have: get.len() as u64 - 1,
        },
    );
    let mut b = ping.clone();
    b[6] = 200;
    check(&b, FrameError::UnknownOpcode(200));
    let b = frame(Header::request(Opcode::Ping, 1, 0, 3), &[], &[1, 2, 3]);
    check(&b, FrameError::UnexpectedPayload { op: "ping", len: 3 });
    // Trailing bytes after the metadata's last field.
    let mut meta = Request::Release { lease_id: 1 }.encode_meta();
    meta.push(0);
    let b = frame(
        Header::request(Opcode::Release, 1, meta.len(), 0),
        &meta,
        &[],
    );
    assert!(matches!(
        decode_frame(&b, &Limits::default()),
        Err(FrameError::BadMeta {
            what: "release",
            ..
        })
    ));
    // A key count that claims more keys than the bytes hold.
    let mut meta = vec![0xff; 8];
    meta.extend_from_slice(&[0; 16]);
    let b = frame(
        Header::request(Opcode::Lookup, 1, meta.len(), 0),
        &meta,
        &[],
    );
    assert!(matches!(
        decode_frame(&b, &Limits::default()),
        Err(FrameError::BadMeta { what: "lookup", .. })
    ));
}

#[test]
fn key_counts_over_the_limit_are_refused() {
    let limits = Limits {
        max_keys: 4,
        ..Limits::default()
    };
    let r = Request::Lookup(KeyList {
        keys: (0..5).map(k).collect(),
    });
    let got = decode_frame(&request_frame(&r, &[]), &limits)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(
        got,
        FrameError::TooManyKeys {
            what: "lookup",
            count: 5,
            limit: 4
        }
    );
    assert!(!got.is_fatal());
    assert_eq!(got.code(), ErrorCode::TooLarge);
}

/// The strictness rules `docs/protocol.md` states: metadata is decoded exactly (a trailing
/// byte is an error), a `bool` is 0 or 1, an `Option` tag is 0 or 1, a string is UTF-8.
/// Each case: (what, request metadata bytes as sent).
#[test]
fn metadata_is_decoded_strictly() {
    fn check(what: &str, op: Opcode, meta: &[u8], ok: bool) {
        let b = frame(Header::request(op, 1, meta.len(), 0), meta, &[]);
        let r = decode_frame(&b, &Limits::default());
        assert_eq!(r.is_ok(), ok, "{what}: {r:?}");
        if let Err(e) = r {
            assert!(
                !e.is_fatal(),
                "{what}: a delimited frame's error keeps the stream"
            );
            assert_eq!(e.code(), ErrorCode::BadRequest, "{what}");
        }
    }
    let hello = |client: &[u8], want_arena: u8| {
        let mut m = Vec::new();
        m.extend_from_slice(&1u16.to_le_bytes());
        m.extend_from_slice(&1u16.to_le_bytes());
        m.extend_from_slice(&(client.len() as u64).to_le_bytes());
        m.extend_from_slice(client);
        m.extend_from_slice(&0u64.to_le_bytes()); // token ""
        m.extend_from_slice(&0u64.to_le_bytes()); // block_bytes
        m.push(want_arena);
        m
    };
    check(
        "hello as the SDK sends it",
        Opcode::Hello,
        &hello(b"w", 1),
        true,
    );
    check("bool 2", Opcode::Hello, &hello(b"w", 2), false);
    check(
        "invalid UTF-8",
        Opcode::Hello,
        &hello(&[0xff, 0xfe], 0),
        false,
    );
    let mut trailing = hello(b"w", 0);
    trailing.push(0);
    check("a trailing byte", Opcode::Hello, &trailing, false);
    check("ping with no metadata", Opcode::Ping, &[], true);
    check("ping with a trailing byte", Opcode::Ping, &[0], false);
    let subscribe = |tag: u8, rest: &[u8]| {
        let mut m = vec![tag];
        m.extend_from_slice(rest);
        m
    };
    check("option none", Opcode::Subscribe, &subscribe(0, &[1]), true);
    let some: Vec<u8> = 7u64.to_le_bytes().into_iter().chain([0]).collect();
    check("option some", Opcode::Subscribe, &subscribe(1, &some), true);
    check(
        "option tag 2",
        Opcode::Subscribe,
        &subscribe(2, &some),
        false,
    );
}

/// A retention hint: session u64, keys (u64 count + 16 bytes each), return_ms u64,
/// priority u8; at least one key, `return_ms` at most a day, priority at most 7, each refused
/// as a delimited bad request (too many keys: too large).
#[test]
fn retain_hint_is_decoded_strictly() {
    let hint = |n: u64, return_ms: u64, priority: u8| {
        let mut m = Vec::new();
        m.extend_from_slice(&5u64.to_le_bytes());
        m.extend_from_slice(&n.to_le_bytes());
        for i in 0..n {
            m.extend_from_slice(&k(u128::from(i) + 1).as_bytes()[..]);
        }
        m.extend_from_slice(&return_ms.to_le_bytes());
        m.push(priority);
        m
    };
    // The golden layout is what the encoder writes.
    let r = Request::Retain(RetainHint {
        session: 5,
        keys: vec![k(1), k(2)],
        return_ms: 1500,
        priority: 3,
    });
    assert_eq!(r.encode_meta(), hint(2, 1500, 3));
    let limits = Limits {
        max_keys: 4,
        ..Limits::default()
    };
    let check = |what: &str, meta: &[u8], want: Result<(), ErrorCode>| {
        let b = frame(Header::request(Opcode::Retain, 1, meta.len(), 0), meta, &[]);
        let r = decode_frame(&b, &limits);
        match (&r, want) {
            (Ok(_), Ok(())) => {}
            (Err(e), Err(code)) => {
                assert!(!e.is_fatal(), "{what}: delimited");
                assert_eq!(e.code(), code, "{what}: {e}");
            }
            _ => panic!("{what}: {r:?}, wanted {want:?}"),
        }
    };
    check("as the SDK sends it", &hint(2, 1500, 3), Ok(()));
    check(
        "the limits themselves",
        &hint(4, MAX_RETAIN_RETURN_MS, 7),
        Ok(()),
    );
    check("no keys", &hint(0, 1500, 3), Err(ErrorCode::BadRequest));
    check("too many keys", &hint(5, 1500, 3), Err(ErrorCode::TooLarge));
    check(
        "return over a day",
        &hint(1, MAX_RETAIN_RETURN_MS + 1, 0),
        Err(ErrorCode::BadRequest),
    );
    check("priority 8", &hint(1, 1500, 8), Err(ErrorCode::BadRequest));
    let mut trailing = hint(1, 1500, 0);
    trailing.push(0);
    check("a trailing byte", &trailing, Err(ErrorCode::BadRequest));
    let short = hint(1, 1500, 0);
    check(
        "no priority byte",
        &short[..short.len() - 1],
        Err(ErrorCode::BadRequest),
    );
    // A payload on a retain is refused too.
    let m = hint(1, 1500, 0);
    let b = frame(Header::request(Opcode::Retain, 1, m.len(), 4), &m, &[0; 4]);
    assert!(decode_frame(&b, &limits).is_err());
}

/// `max_keys` and `max_meta_bytes` both bound a request: with the defaults (65,536 keys,
/// 1 MiB) a key list reaches the metadata limit first (65,535 keys), and a put of a chain
/// from its root (17 bytes for the root entry, 33 for each with a parent) at 31,775
/// entries, as `docs/protocol.md` says.
#[test]
fn the_metadata_limit_binds_before_the_key_limit() {
    let l = Limits::default();
    let fits = |r: &Request| r.encode_meta().len() <= l.max_meta_bytes as usize;
    let keys = |n: usize| (0..n as u128).map(k).collect::<Vec<_>>();
    assert!(fits(&Request::Get(KeyList { keys: keys(65_535) })));
    assert!(!fits(&Request::Get(KeyList { keys: keys(65_536) })));
    let chain = |n: usize| {
        (0..n as u128)
            .map(|i| PutEntry {
                key: k(i + 1),
                // A chain from the root: the first block has no parent.
                parent: (i > 0).then(|| k(i)),
            })
            .collect::<Vec<_>>()
    };
    assert!(fits(&Request::Put(chain(31_775))));
    assert!(!fits(&Request::Put(chain(31_776))));
    let pin = |n| Request::Pin {
        keys: keys(n),
        lease_ms: 1,
    };
    assert!(fits(&pin(65_535)));
    assert!(!fits(&pin(65_536)));
}

#[test]
fn codes_round_trip_and_unknown_ones_are_none() {
    for &op in Opcode::ALL {
        assert_eq!(Opcode::from_u8(op as u8), Some(op));
    }
    assert_eq!(Opcode::from_u8(0), None);
    assert_eq!(Opcode::from_u8(18), None);
    for v in 0..=255u8 {
        if let Some(c) = PutStatus::from_u8(v) {
            assert_eq!(c as u8, v);
        }
        if let Some(c) = MissCode::from_u8(v) {
            assert_eq!(c as u8, v);
        }
        if let Some(c) = TierCode::from_u8(v) {
            assert_eq!(c as u8, v);
        }
    }
    for v in 0..=20u16 {
        if let Some(c) = ErrorCode::from_u16(v) {
            assert_eq!(c as u16, v);
        }
    }
    assert_eq!(ErrorCode::from_u16(0), None);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
        let _ = decode_frame(&bytes, &Limits::default());
    }

    #[test]
    fn mutated_valid_frames_never_panic(i in 0usize..16, pos in 0usize..512, byte in proptest::prelude::any::<u8>()) {
        let reqs = all_requests();
        let r = &reqs[i % reqs.len()];
        let mut b = request_frame(r, &[]);
        let p = pos % b.len();
        b[p] = byte;
        let _ = decode_frame(&b, &Limits::default());
    }
}

#[test]
fn a_fetch_reply_with_sums_not_matching_its_blocks_is_refused() {
    let r = Response::Fetch(FetchReply {
        tiers: vec![1, 1],
        miss: 0,
        sums: vec![1],
    });
    let (fl, meta) = r.encode_meta();
    let mut h = Header::request(Opcode::Fetch, 1, meta.len(), 0);
    h.flags = fl;
    let e = Response::decode(&h, &meta, &Limits::default()).unwrap_err();
    assert!(e.to_string().contains("1 sums for 2 blocks"), "{e}");
}

#[test]
fn a_locate_reply_with_sums_not_matching_its_blocks_is_refused() {
    let r = Response::Locate(LocateReply {
        pin: PinReply {
            lease_id: 1,
            lease_ms: 10,
            blocks: vec![PinnedSlot { offset: 0, tier: 1 }],
            miss: 0,
        },
        sums: vec![1, 2],
    });
    let (fl, meta) = r.encode_meta();
    let mut h = Header::request(Opcode::Locate, 1, meta.len(), 0);
    h.flags = fl;
    let e = Response::decode(&h, &meta, &Limits::default()).unwrap_err();
    assert!(e.to_string().contains("2 sums for 1 blocks"), "{e}");
}

#[test]
fn lookup_reply_golden_bytes_in_both_versions() {
    // Version 3: u64-prefixed tiers, the miss byte. Version 4 appends the u64-prefixed
    // sources, each u32 start, u32 len, u64-prefixed node id.
    let v3 = Response::Lookup {
        tiers: vec![1, 3],
        miss: 1,
        sources: None,
    };
    let m3 = vec![2, 0, 0, 0, 0, 0, 0, 0, 1, 3, 1];
    let mut m4 = m3.clone();
    m4.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]);
    m4.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0, b'n', b'1']);
    let v4 = Response::Lookup {
        tiers: vec![1, 3],
        miss: 1,
        sources: Some(vec![BlockSource {
            start: 1,
            len: 1,
            node: "n1".into(),
        }]),
    };
    assert_eq!(v4.encode_meta().1, m4);
    assert_eq!(v3.encode_meta().1, m3);
    let h = Header::request(Opcode::Lookup, 1, 0, 0);
    let limits = Limits::default();
    assert_eq!(Response::decode(&h, &m4, &limits).unwrap(), v4);
    // Version 3's form cannot carry a remote block: none of its blocks is in a run.
    let e = Response::decode(&h, &m3, &limits).unwrap_err();
    assert!(e.to_string().contains("remote block 1 in no run"), "{e}");
    let mut plain = m3.clone();
    plain[9] = 2;
    assert_eq!(
        Response::decode(&h, &plain, &limits).unwrap(),
        Response::Lookup {
            tiers: vec![1, 2],
            miss: 1,
            sources: None,
        }
    );
}

#[test]
fn lookup_sources_that_do_not_match_the_tiers_are_refused() {
    let src = |start, len, node: &str| BlockSource {
        start,
        len,
        node: node.into(),
    };
    let cases: Vec<(Vec<u8>, Vec<BlockSource>, &str)> = vec![
        (vec![1, 3], vec![src(1, 2, "a")], "run 1+2"),
        (vec![3, 3], vec![src(0, 0, "a")], "run 0+0"),
        (vec![3, 3], vec![src(0, 1, "")], "run 0+1"),
        (vec![3, 3], vec![src(0, 2, "a"), src(1, 1, "b")], "run 1+1"),
        (
            vec![3, 1],
            vec![src(0, 2, "a")],
            "block 1 of a run is not remote",
        ),
        (vec![3, 3], vec![src(0, 1, "a")], "remote block 1 in no run"),
        (
            vec![3, 1, 3],
            vec![src(2, 1, "a")],
            "remote block 0 in no run",
        ),
        (vec![1], vec![src(u32::MAX, 2, "a")], "run 4294967295+2"),
        (
            vec![3],
            vec![src(0, 1, &"n".repeat(MAX_NODE_BYTES + 1))],
            "node",
        ),
    ];
    let h = Header::request(Opcode::Lookup, 1, 0, 0);
    for (tiers, sources, want) in cases {
        let r = Response::Lookup {
            tiers: tiers.clone(),
            miss: 0,
            sources: Some(sources.clone()),
        };
        let (_, meta) = r.encode_meta();
        let e = Response::decode(&h, &meta, &Limits::default()).unwrap_err();
        assert!(e.to_string().contains(want), "{tiers:?} {sources:?}: {e}");
    }
}

#[test]
fn frames_carry_the_header_version_every_side_reads() {
    // A side that speaks only version 3 reads a newer side's frames: the framing is 3's.
    let h = Header::request(Opcode::Lookup, 1, 0, 0);
    assert_eq!(h.version, 3);
    assert_eq!(HEADER_VERSION, MIN_VERSION);
    let mut b = h.encode();
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    assert_eq!(
        Header::decode(&b, &Limits::default()).unwrap().version,
        VERSION
    );
    b[4..6].copy_from_slice(&(VERSION + 1).to_le_bytes());
    assert!(Header::decode(&b, &Limits::default()).is_err());
}

#[test]
fn block_sum_binds_key_and_bytes() {
    let a = block_sum(&k(1), b"block");
    assert_eq!(a, block_sum(&k(1), b"block"));
    assert_ne!(a, block_sum(&k(2), b"block"));
    assert_ne!(a, block_sum(&k(1), b"blocK"));
    assert_ne!(a, block_sum(&k(1), b"bloc"));
}

/// A key list's metadata appended from a borrowed list is byte for byte the metadata of the
/// request that owns it, after whatever the buffer held.
#[test]
fn key_list_meta_appended_is_the_requests() {
    for n in [0u128, 1, 2, 4096] {
        let keys: Vec<BlockKey> = (0..n).map(|i| k(i * 0x9e37_79b9 + 1)).collect();
        let mut out = b"head".to_vec();
        append_key_list_meta(&keys, &mut out);
        let want = Request::Lookup(KeyList { keys }).encode_meta();
        assert_eq!(&out[..4], b"head");
        assert_eq!(out[4..], want[..], "{n} keys");
    }
}
