"""kvtier-server's block events in vLLM's KV-events wire format (``events.zmq``), read the way
llm-d's KV-cache manager or Dynamo's router read a vLLM engine's: a ZMQ SUB socket (pyzmq) and
vLLM's own definitions (``vllm.distributed.kv_events.KVEventBatch`` decoded by msgspec), not a
copy of kvtier's."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import kvtier
import msgspec
import numpy as np
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm_harness import BLOCK, BLOCK_BYTES, KvtierServer, free_dir, remove, server_binary


@pytest.fixture()
def stack():
    work = free_dir("kvtier-zmq-")
    srv = KvtierServer(work / "srv", extra=['events.zmq="tcp://127.0.0.1:0"'])
    srv.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(srv.endpoints["zmq"])
    try:
        yield srv, sub
    finally:
        sub.close(0)
        ctx.term()
        srv.kill()
        remove(work)


def receive(sub, until: float) -> list[tuple[int, KVEventBatch]]:
    """Every message until ``until`` (a time.monotonic), as (sequence, batch)."""
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    out = []
    while time.monotonic() < until:
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            continue
        assert topic == b""
        out.append((int.from_bytes(seq, "big"), dec.decode(payload)))
    return out


def wait_for(sub, want, timeout: float = 15.0) -> list[tuple[int, KVEventBatch]]:
    """Messages until ``want(events so far)`` holds (or the timeout)."""
    got: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += receive(sub, min(deadline, time.monotonic() + 0.3))
        if want([e for _, b in got for e in b.events]):
            break
    return got


def test_store_remove_clear_in_vllms_format(stack) -> None:
    srv, sub = stack
    client = kvtier.Client(srv.url, timeout=10.0)
    blocks = np.random.default_rng(3).integers(0, 255, (3, BLOCK_BYTES), dtype=np.uint8)
    # A PUB socket drops what is published before the subscription reaches it (ZMQ's slow
    # joiner): probe with blocks of their own until one's event arrives.
    probe_deadline = time.monotonic() + 15
    while True:
        probe = os.urandom(16)
        client.put_chain([probe], blocks[:1])
        if receive(sub, time.monotonic() + 0.3):
            break
        assert time.monotonic() < probe_deadline, "no event on events.zmq within 15 s"
    time.sleep(0.3)
    receive(sub, time.monotonic() + 0.3)  # the probes' remaining events

    keys = [os.urandom(16) for _ in range(3)]
    assert client.put_chain(keys, blocks).cached == 3

    def stored_in_dram(evs) -> set[bytes]:
        return {
            h
            for e in evs
            if isinstance(e, BlockStored) and e.medium == "CPU"
            for h in e.block_hashes
        }

    got = wait_for(sub, lambda evs: set(keys) <= stored_in_dram(evs))
    evs = [e for _, b in got for e in b.events]
    assert set(keys) <= stored_in_dram(evs), evs
    for e in evs:
        if isinstance(e, BlockStored):
            assert e.block_size == BLOCK and e.token_ids == [] and e.parent_block_hash is None
            assert e.medium in ("CPU", "STORAGE") and len(e.block_hashes) == 1
    seqs = [s for s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no gap

    assert client.remove(keys[:2]) == 2
    got = wait_for(
        sub,
        lambda evs: (
            {h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes} >= set(keys[:2])
        ),
    )
    removed = {
        h for _, b in got for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
    }
    assert set(keys[:2]) <= removed and keys[2] not in removed

    client.clear()
    got = wait_for(sub, lambda evs: any(isinstance(e, AllBlocksCleared) for e in evs))
    assert any(isinstance(e, AllBlocksCleared) for _, b in got for e in b.events)


def test_events_zmq_is_refused_with_tenants(tmp_path: Path) -> None:
    """The stream has no authentication: with tenants it would show every tenant's keys."""
    sets = [
        f'server.runtime_dir="{tmp_path}"',
        'events.zmq="tcp://127.0.0.1:0"',
        'tenants.a={token="token-of-a-0123456789"}',
    ]
    args = [str(server_binary())]
    for s in sets:
        args += ["--set", s]
    # KVTIER_* variables are configuration to the server (KVTIER_SERVER_BIN would be one).
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert "events.zmq" in r.stderr and "tenants" in r.stderr, r.stderr
