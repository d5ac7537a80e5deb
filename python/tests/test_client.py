"""The client against a real kvtier-server: round trips over every transport, the zero-copy
local path, misses as results, misuse as exceptions, events, and concurrent threads."""

from __future__ import annotations

import hashlib
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BLOCK, TOKEN, Server, fresh_keys, start_server

import kvtier


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def test_unix_round_trip_is_zero_copy_into_numpy(unix_client: kvtier.Client) -> None:
    c = unix_client
    assert c.is_local and c.block_bytes == BLOCK
    keys = fresh_keys(4)
    data = blocks(4, 1)
    stored = c.put_chain(keys, data)
    assert stored.failure is None and stored.cached == 4, stored
    assert stored.statuses == ["stored"] * 4

    look = c.lookup(keys)
    assert look.blocks == 4 and look.miss is None and look.tiers == ["dram"] * 4
    assert look.sources == []

    out = np.zeros((4, BLOCK), dtype=np.uint8)
    got = c.get_into(keys, out)
    assert got.blocks == 4 and got.miss is None and got.tiers == ["dram"] * 4
    np.testing.assert_array_equal(out, data)

    # Again: already present.
    assert c.put_chain(keys, data).statuses == ["already_present"] * 4


def test_tcp_round_trip_with_a_list_of_buffers(server: Server, tcp_client: kvtier.Client) -> None:
    c = tcp_client
    assert not c.is_local
    keys = fresh_keys(3)
    data = [bytes(blocks(1, 2 + i)[0]) for i in range(3)]
    # bytes, memoryview and bytearray all read as sources.
    srcs = [data[0], memoryview(data[1]), bytearray(data[2])]
    assert c.put_chain(keys, srcs).cached == 3
    out = [bytearray(BLOCK), np.zeros(BLOCK, np.uint8), memoryview(bytearray(BLOCK))]
    got = c.get_into(keys, out)
    assert got.blocks == 3 and got.miss is None
    assert [bytes(o) for o in out] == data
    # The Unix client sees what TCP stored: one cache.
    local = np.zeros((3, BLOCK), np.uint8)
    assert kvtier.Client(server.unix_url).get_into(keys, local).blocks == 3
    assert local.tobytes() == b"".join(data)


def test_quic_round_trip_with_the_pinned_certificate(server: Server) -> None:
    c = kvtier.Client(server.quic_url, token=TOKEN, quic_cert=server.quic_cert)
    keys = fresh_keys(2)
    data = blocks(2, 7)
    assert c.put_chain(keys, data).cached == 2
    out = np.zeros_like(data)
    assert c.get_into(keys, out).blocks == 2
    np.testing.assert_array_equal(out, data)
    # The same certificate as DER bytes.
    der = server.quic_cert.read_bytes()
    assert kvtier.Client(server.quic_url, token=TOKEN, quic_cert=der).lookup(keys).blocks == 2


def test_tls_round_trip_with_the_pinned_certificate(server: Server) -> None:
    c = kvtier.Client(server.tls_url, token=TOKEN, server_cert=server.quic_cert)
    assert not c.is_local
    keys = fresh_keys(2)
    data = blocks(2, 9)
    assert c.put_chain(keys, data).cached == 2
    out = np.zeros_like(data)
    assert c.get_into(keys, out).blocks == 2
    np.testing.assert_array_equal(out, data)
    # DER bytes, and the former name quic_cert, serve tls:// too.
    der = server.quic_cert.read_bytes()
    assert kvtier.Client(server.tls_url, token=TOKEN, quic_cert=der).lookup(keys).blocks == 2
    # The certificate must be the server's, under the name it carries.
    with pytest.raises(ConnectionError, match="TLS handshake"):
        kvtier.Client(server.tls_url, token=TOKEN, server_cert=der, server_name="kv.example")
    with pytest.raises(ConnectionError, match="server_cert_der"):
        kvtier.Client(server.tls_url, token=TOKEN)
    # A plaintext client on the TLS port is told what to use.
    with pytest.raises(PermissionError, match="tls://"):
        kvtier.Client(f"tcp://{server.tls}", token=TOKEN)


def client_certificate(directory: Path) -> tuple[Path, bytes, str]:
    """A self-signed client certificate (DER file), its PKCS#8 key (DER bytes) and the
    SHA-256 a tenant pins it by, made with the openssl command."""
    cert, pem = directory / "client.der", directory / "client-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + ["-nodes", "-subj", "/CN=py-client", "-days", "2", "-outform", "DER"]
        + ["-keyout", str(pem), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    key = subprocess.run(
        ["openssl", "pkcs8", "-topk8", "-nocrypt", "-in", str(pem), "-outform", "DER"],
        check=True,
        capture_output=True,
    ).stdout
    return cert, key, hashlib.sha256(cert.read_bytes()).hexdigest()


def test_a_pinned_client_certificate_names_the_tenant(tmp_path: Path) -> None:
    cert, key, digest = client_certificate(tmp_path)
    srv = start_server(
        tmp_path / "srv",
        [
            'server.token=""',
            f'tenants.a={{client_cert_sha256=["{digest}"], token="tok-a"}}',
            'tenants.b={token="tok-b"}',
        ],
    )
    try:
        keys, data = fresh_keys(2), blocks(2, 11)
        for url in (srv.tls_url, srv.quic_url):
            # The certificate alone (a path and DER bytes) names tenant a.
            a = kvtier.Client(url, server_cert=srv.quic_cert, client_cert=cert, client_key=key)
            assert a.put_chain(keys, data).cached == 2
            assert kvtier.Client(srv.tcp_url, token="tok-a").lookup(keys).blocks == 2
            assert kvtier.Client(srv.tcp_url, token="tok-b").lookup(keys).blocks == 0
            with pytest.raises(PermissionError, match="the token another"):
                kvtier.Client(
                    url,
                    token="tok-b",
                    server_cert=srv.quic_cert,
                    client_cert=cert.read_bytes(),
                    client_key=key,
                )
        with pytest.raises(ValueError, match="together"):
            kvtier.Client(srv.tls_url, server_cert=srv.quic_cert, client_cert=cert)
    finally:
        assert srv.stop() == 0


def test_copy_path_on_unix_without_zero_copy(server: Server) -> None:
    c = kvtier.Client(server.unix_url, zero_copy=False)
    assert not c.is_local
    keys = fresh_keys(2)
    data = blocks(2, 11)
    assert c.put_chain(keys, data).cached == 2
    out = np.zeros_like(data)
    assert c.get_into(keys, out).blocks == 2
    np.testing.assert_array_equal(out, data)


def test_lookups_answered_in_place_or_asked_give_the_same_answer(server: Server) -> None:
    # local_lookups (the default) answers from the server's slot table where it settles the
    # lookup; off, every lookup asks the server. Same answers either way.
    here = kvtier.Client(server.unix_url)
    asks = kvtier.Client(server.unix_url, local_lookups=False)
    keys = fresh_keys(3)
    assert here.put_chain(keys[:2], blocks(2, 5)).cached == 2
    for ks in (keys[:2], keys):
        a, b = here.lookup(ks), asks.lookup(ks)
        assert (a.blocks, a.miss, a.tiers) == (b.blocks, b.miss, b.tiers), (a, b)
    assert here.lookup(keys[:2]).tiers == ["dram", "dram"]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_miss_is_a_result(transport: str, unix_client, tcp_client) -> None:
    c = unix_client if transport == "unix" else tcp_client
    keys = fresh_keys(4)
    look = c.lookup(keys)
    assert (look.blocks, look.miss, look.tiers) == (0, "not_cached", [])
    # A cached prefix of two, then a miss: the first two buffers are filled.
    data = blocks(2, 3)
    assert c.put_chain(keys[:2], data).cached == 2
    out = np.zeros((4, BLOCK), np.uint8)
    got = c.get_into(keys, out)
    assert (got.blocks, got.miss) == (2, "not_cached")
    np.testing.assert_array_equal(out[:2], data)
    assert not out[2:].any()
    assert c.lookup(keys).blocks == 2
    # A block whose parent is not cached is refused, not raised.
    orphan = c.put_chain(keys[3:], data[:1], parent=keys[2])
    assert orphan.statuses == ["rejected_orphan"] and orphan.cached == 0


def test_retain_protects_a_cached_prefix_and_says_why_not(unix_client: kvtier.Client) -> None:
    keys = fresh_keys(3)
    assert unix_client.put_chain(keys, blocks(3, 4)).cached == 3
    r = unix_client.retain(keys, 10.0, session=7)
    assert r == {"status": "accepted", "blocks": 3, "hold_s": 15.0}
    assert unix_client.retain(fresh_keys(2), 10.0)["status"] == "nothing_cached"
    assert unix_client.retain(keys, 301.0)["status"] == "too_far"
    with pytest.raises(RuntimeError, match="priority up to 7"):
        unix_client.retain(keys, 1.0, priority=8)
    with pytest.raises(ValueError, match="expected_return_s"):
        unix_client.retain(keys, -1.0)
    assert unix_client.stats()["store"]["retain"]["accepted"] >= 1


def test_put_with_explicit_parents(unix_client: kvtier.Client) -> None:
    keys = fresh_keys(2)
    data = blocks(2, 5)
    s = unix_client.put(keys, [None, keys[0]], data)
    assert s.cached == 2
    with pytest.raises(ValueError, match="2 keys but 1 parents"):
        unix_client.put(keys, [None], data)


def test_an_absent_server_raises_at_connect_only(tmp_path) -> None:
    with pytest.raises(ConnectionError, match="cannot connect"):
        kvtier.Client(f"unix://{tmp_path}/none.sock")


def test_a_server_that_goes_away_is_a_miss_and_the_client_reconnects(tmp_path) -> None:
    from conftest import start_server

    srv = start_server(tmp_path)
    c = kvtier.Client(srv.unix_url, timeout=2.0, reconnect_backoff=0.2)
    keys = fresh_keys(2)
    assert c.put_chain(keys, blocks(2, 9)).cached == 2
    assert srv.stop() == 0
    look = c.lookup(keys)
    assert look.blocks == 0 and look.miss in ("disconnected", "unavailable"), look
    got = c.get_into(keys, np.zeros((2, BLOCK), np.uint8))
    assert got.blocks == 0 and got.miss in ("disconnected", "unavailable"), got
    stored = c.put_chain(keys, blocks(2, 9))
    assert stored.cached == 0 and stored.failure in ("disconnected", "unavailable"), stored
    # A server on the same socket again: a later call reconnects.
    srv = start_server(tmp_path)
    try:
        deadline = time.monotonic() + 10
        while c.put_chain(keys, blocks(2, 9)).cached != 2:
            assert time.monotonic() < deadline, "the client did not reconnect"
            time.sleep(0.1)
        out = np.zeros((2, BLOCK), np.uint8)
        assert c.get_into(keys, out).blocks == 2
        np.testing.assert_array_equal(out, blocks(2, 9))
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c, k: c.get_into(k, np.zeros((2, BLOCK - 1), np.uint8)), ValueError, "bytes"),
        (lambda c, k: c.get_into(k, [bytearray(BLOCK)]), ValueError, "2 keys but 1 buffers"),
        (lambda c, k: c.get_into(k, [bytearray(BLOCK), bytearray(5)]), ValueError, "buffer 1"),
        (lambda c, k: c.get_into(k, bytes(2 * BLOCK)), ValueError, "read-only"),
        (
            lambda c, k: c.get_into(k, np.zeros((2 * BLOCK, 2), np.uint8)[:, 0]),
            ValueError,
            "not C-contiguous",
        ),
        (lambda c, k: c.get_into(k, [np.zeros(BLOCK, np.uint8)] * 2), ValueError, "overlap"),
        (lambda c, k: c.get_into(k, 12), TypeError, "does not export a buffer"),
        (lambda c, k: c.put_chain(k, bytes(BLOCK)), ValueError, "2 blocks"),
        (lambda c, k: c.lookup([b"short"]), ValueError, "key 0: a key is 16 bytes, got 5"),
        (lambda c, k: c.lookup([k[0].hex()]), TypeError, "not a str"),
        (lambda c, k: c.lookup(k[0]), TypeError, "wrap it in a list"),
        (lambda c, k: c.put_chain(k, bytes(2 * BLOCK), parent=b"x"), ValueError, "parent"),
    ],
)
def test_misuse_raises_with_a_clear_message(unix_client, call, error, message) -> None:
    with pytest.raises(error, match=message):
        call(unix_client, fresh_keys(2))


@pytest.mark.parametrize(
    ("url", "kwargs", "error", "message"),
    [
        ("http://x:1", {}, ValueError, "bad server address"),
        ("tcp://nohost", {}, ValueError, "bad server address"),
        ("unix://", {}, ValueError, "bad server address"),
        ("unix:///x", {"timeout": 0}, ValueError, "timeout"),
        ("unix:///x", {"lease": -1.0}, ValueError, "lease"),
        ("tls://nohost", {}, ValueError, "bad server address"),
        ("tls://h:1", {"server_cert": b"x", "quic_cert": b"x"}, ValueError, "not both"),
        ("tls://h:1", {"server_name": "a", "quic_server_name": "b"}, ValueError, "not both"),
    ],
)
def test_bad_settings_raise(url, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        kvtier.Client(url, **kwargs)


def test_refusals_at_connect(server: Server) -> None:
    with pytest.raises(PermissionError):
        kvtier.Client(server.tcp_url, token="wrong-token")
    with pytest.raises(ValueError, match="LayoutMismatch"):
        kvtier.Client(server.unix_url, block_bytes=BLOCK * 2)
    with pytest.raises(ConnectionError, match="certificate"):
        kvtier.Client(server.quic_url, token=TOKEN)


def test_stats_prefetch_remove_ping(unix_client: kvtier.Client) -> None:
    c = unix_client
    stats = c.stats()
    assert isinstance(stats, dict) and stats, stats
    keys = fresh_keys(2)
    c.put_chain(keys, blocks(2, 4))
    assert c.prefetch(keys) == 0  # in DRAM already: nothing to promote
    assert c.remove(keys) == 2
    assert c.lookup(keys).blocks == 0
    assert 0 < c.ping() < 5


def test_events_iterate_stored_and_removed(unix_client: kvtier.Client) -> None:
    c = unix_client
    stream = c.events()
    assert stream.start_seq >= 0
    keys = fresh_keys(2)
    c.put_chain(keys, blocks(2, 6))
    c.remove(keys[1:])
    seen: list[tuple[str, bytes, str | None]] = []
    seqs: list[int] = []
    deadline = time.monotonic() + 10
    while ("removed", keys[1]) not in [(k, key) for k, key, _ in seen]:
        assert time.monotonic() < deadline, seen
        ev = stream.next(timeout=1.0)
        if isinstance(ev, kvtier.BlockEvent) and ev.key in keys:
            seen.append((ev.kind, ev.key, ev.tier))
            seqs.append(ev.seq)
    # Stored in DRAM (and possibly copied to NVMe: more "stored" events), then removed.
    assert seen[0] == ("stored", keys[0], "dram"), seen
    assert ("stored", keys[1], "dram") in seen[:-1], seen
    assert seen[-1][:2] == ("removed", keys[1]), seen
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    # A snapshot lists cached blocks as stored events with sequence 0.
    snap = c.events(snapshot=True)
    found = False
    for ev in snap:
        if isinstance(ev, kvtier.BlockEvent) and ev.key == keys[0]:
            assert (ev.seq, ev.kind, ev.tier) == (0, "stored", "dram")
            found = True
            break
    assert found


def test_the_gil_is_released_while_waiting(unix_client: kvtier.Client) -> None:
    stream = unix_client.events()
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        # A call that waits its whole 0.3 s in Rust (events of earlier tests, e.g. their NVMe
        # copies, may still arrive: those calls return early and do not count).
        during = None
        for _ in range(50):
            before = ticks
            if stream.next(timeout=0.3) is None:
                during = ticks - before
                break
        assert during is not None, "events kept arriving"
    finally:
        stop.set()
        t.join()
    # With the GIL held for 0.3 s the spinning thread could not have run at all.
    assert during > 1000, during


def test_one_client_many_threads(server: Server) -> None:
    c = kvtier.Client(server.unix_url)
    t = kvtier.Client(server.tcp_url, token=TOKEN)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            client = c if i % 2 else t
            for round_ in range(5):
                keys = fresh_keys(2)
                data = blocks(2, 1000 * i + round_)
                assert client.put_chain(keys, data).cached == 2
                out = np.zeros_like(data)
                got = client.get_into(keys, out)
                assert got.blocks == 2, got
                np.testing.assert_array_equal(out, data)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors


def test_results_print_as_python(unix_client: kvtier.Client) -> None:
    keys = fresh_keys(1)
    assert (
        repr(unix_client.lookup(keys))
        == "Lookup(blocks=0, tiers=[], sources=[], miss='not_cached')"
    )
    stored = unix_client.put_chain(keys, blocks(1, 8))
    assert repr(stored) == "Stored(cached=1, statuses=['stored'], failure=None)"
    got = unix_client.get_into(keys, np.zeros((1, BLOCK), np.uint8))
    assert repr(got) == "Fetch(blocks=1, tiers=['dram'], miss=None)"
