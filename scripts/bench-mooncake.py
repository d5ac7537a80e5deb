#!/usr/bin/env python3
"""kvtier against Mooncake Store in one run (issue 13 item 7).

One client, loopback, the same value sizes and working sets for every path; each get lands in a
caller's buffer and is compared byte for byte with the value that was put (outside the timed
call). Paths:

  mooncake tcp   Mooncake Store's `get_into` in a full client (`setup`, protocol "tcp", no
                 segment of its own, its buffers registered with `register_buffer`) from the
                 segment of another process (`mooncake_client`, the standalone real client):
                 the bytes come over Mooncake's TCP transport.
  mooncake shm   Mooncake Store's shared-memory client: a dummy client (`setup_dummy`) whose
                 buffers come from its shared-memory pool (`alloc_from_mem_pool`, then
                 `register_buffer`); a get is an RPC to the real client (`mooncake_client`),
                 which copies the value from its segment into that shared memory.
  kvtier unix    kvtier's Python package, `Client.get_into` over the Unix socket (zero copy:
                 one copy from the server's DRAM arena, mapped read-only, into the buffer).
  kvtier tcp     the same call over TCP to the server (the value is in that server's DRAM).
  kvtier remote  the cluster's remote get: two kvtier servers, members of one cluster on an etcd
                 the script starts (`--etcd`), every value put on member a and owned by it; a
                 client beside member b (its Unix socket, as a worker there) looks the keys up,
                 which makes b fetch them from a over the peer protocol (TCP; verified on
                 arrival, stored in b's DRAM), then gets them from b (zero copy).
                 "kvtier remote tcp" is the same with the client on b's TCP port (two hops).
                 b's DRAM holds a quarter of the values, so each call's values were evicted
                 there since they last came: every call crosses the peer path (the script
                 prints b's count of fetched blocks against the blocks asked for). The timed
                 call is the lookup and the get. Needs a kvtier-server built with the
                 `cluster` feature; `--no-cluster` skips it.
  memcpy         numpy `copyto` of the same values into the same buffer: the physical reference.

Latency is the timed call alone (perf_counter_ns around it); GB/s is bytes over the summed call
times. Batches (`--batches 1,16`) get that many values a call (`batch_get_into` for Mooncake,
one `get_into` of that many keys for kvtier). With `--kvtier-bench BIN` the Rust SDK's figure
(`kvtier-bench tiers`, unix and tcp gets, 1 client) runs in the same script, after the rest,
and so does kvtier-transfer's TCP backend (`kvtier-bench transfer`, READ): the reference for
the cluster's peer fetch, whose own figures (member b's fetches from a during the "kvtier
remote" cases: count, mean time, bytes over summed time, from b's metrics) are printed in a
last table.

Run it from the venv that scripts/mooncake-env.sh makes:

  venv="$(scripts/mooncake-env.sh)" && "$venv/bin/python" scripts/bench-mooncake.py \\
      --server-bin "$CARGO_TARGET_DIR/release/kvtier-server"
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PATHS = (
    "memcpy",
    "mooncake tcp",
    "mooncake shm",
    "kvtier tcp",
    "kvtier remote tcp",
    "kvtier remote",
    "kvtier unix",
)
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"}
TOKEN = "bench-mooncake-token"
SEGMENT_BYTES = 1 << 30  # the real client's segment: Mooncake wants plain byte counts


def parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, mult in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * mult
    return int(text)


def human(size: int) -> str:
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    return f"{size >> 10} KiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(size: int, count: int, seed: int) -> np.ndarray:
    """`count` distinct values of `size` bytes: random bytes, the index in the first 8."""
    rng = np.random.default_rng(seed)
    vals = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    vals[:, :8] = np.arange(count, dtype=np.uint64).view(np.uint8).reshape(count, 8)
    return vals


@dataclass
class Result:
    path: str
    size: int
    batch: int
    ops: int
    lat_ns: list[int]
    wrong: int
    # The cluster's paths: member b's requests to its peer during the case (see peer_delta).
    peer: dict | None = None

    @property
    def gbps(self) -> float:
        return self.ops * self.batch * self.size / max(sum(self.lat_ns), 1)

    def pct_us(self, q: float) -> float:
        return float(np.percentile(np.array(self.lat_ns), q)) / 1e3

    def as_json(self) -> dict:
        return {
            "path": self.path,
            "size": self.size,
            "batch": self.batch,
            "ops": self.ops,
            "gbps": self.gbps,
            "p50_us": self.pct_us(50),
            "p99_us": self.pct_us(99),
            "wrong": self.wrong,
            **({"peer": self.peer} if self.peer is not None else {}),
        }


def measure(
    path: str,
    size: int,
    batch: int,
    count: int,
    seconds: float,
    get: Callable[[int], None],
    dst: np.ndarray,
    vals: np.ndarray,
) -> Result:
    """Times `get(first)` (which fills `dst[:batch]` with values first..first+batch) until
    `seconds` of wall time pass, after a warm-up pass; checks every value it got."""
    starts = list(range(0, count - batch + 1, batch))
    for first in starts[: min(len(starts), 8)]:
        get(first)
    lat: list[int] = []
    wrong = 0
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline or len(lat) < 20:
        first = starts[i % len(starts)]
        i += 1
        t0 = time.perf_counter_ns()
        get(first)
        lat.append(time.perf_counter_ns() - t0)
        if not np.array_equal(dst[:batch], vals[first : first + batch]):
            wrong += 1
    return Result(path, size, batch, len(lat), lat, wrong)


# ---------------------------------------------------------------- Mooncake


def mooncake_child(args: argparse.Namespace) -> None:
    """One Mooncake case in its own process (one store client a process): put the working
    set, time gets, remove it, print the results as JSON on stdout."""
    from mooncake.store import MooncakeDistributedStore

    size, count, batches = args.size, args.count, [int(b) for b in args.batches.split(",")]
    vals = values(size, count, args.seed)
    max_batch = max(batches)
    store = MooncakeDistributedStore()
    if args.child == "mooncake-tcp":
        # No segment of its own: every value lives in the real client's segment, so gets
        # read it over the TCP transport. local_buffer_size must be > 0.
        rc = store.setup("127.0.0.1", args.metadata, 0, 64 << 20, "tcp", "", args.master, None)
        if rc != 0:
            raise SystemExit(f"mooncake setup failed: {rc}")
        src = vals
        dst = np.zeros((max_batch, size), dtype=np.uint8)
        for arr in (src, dst):
            if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise SystemExit("mooncake register_buffer failed")
    else:
        pool = (count + max_batch) * size
        rc = store.setup_dummy(pool + (64 << 20), 64 << 20, args.real_client)
        if rc != 0:
            raise SystemExit(f"mooncake setup_dummy failed: {rc}")

        def pool_array(rows: int) -> np.ndarray:
            ptr = store.alloc_from_mem_pool(rows * size)
            if not ptr:
                raise SystemExit("mooncake alloc_from_mem_pool failed")
            if store.register_buffer(ptr, rows * size) != 0:
                raise SystemExit("mooncake register_buffer (dummy) failed")
            raw = (ctypes.c_uint8 * (rows * size)).from_address(ptr)
            return np.ctypeslib.as_array(raw).reshape(rows, size)

        src = pool_array(count)
        src[:] = vals
        dst = pool_array(max_batch)
    keys = [f"kvb-{args.child}-{size}-{i}" for i in range(count)]
    src_ptr, dst_ptr = src.ctypes.data, dst.ctypes.data
    for i, key in enumerate(keys):
        rc = store.put_from(key, src_ptr + i * size, size)
        if rc != 0:
            raise SystemExit(f"mooncake put_from({key}) failed: {rc}")
    path = "mooncake " + args.child.removeprefix("mooncake-")
    out = []
    for batch in batches:
        ptrs = [dst_ptr + j * size for j in range(batch)]
        sizes = [size] * batch

        def get(
            first: int, batch: int = batch, ptrs: list[int] = ptrs, sizes: list[int] = sizes
        ) -> None:
            if batch == 1:
                n = store.get_into(keys[first], dst_ptr, size)
                if n != size:
                    raise SystemExit(f"mooncake get_into({keys[first]}) returned {n}")
            else:
                got = store.batch_get_into(keys[first : first + batch], ptrs, sizes)
                if any(n != size for n in got):
                    raise SystemExit(f"mooncake batch_get_into returned {got}")

        dst[:] = 0
        out.append(measure(path, size, batch, count, args.seconds, get, dst, vals).as_json())
    for key in keys:
        store.remove(key, True)  # force: skip the lease
    store.close()
    print(json.dumps(out), flush=True)


class Mooncake:
    """mooncake_master (with its HTTP metadata server) and one mooncake_client (the real client
    holding the segment the values live in), stopped by close()."""

    def __init__(self, venv_bin: Path, logdir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = logdir
        env = {**os.environ, **MOONCAKE_ENV}
        rpc, http, metrics, client = free_port(), free_port(), free_port(), free_port()
        self.master = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        self.real_client = f"127.0.0.1:{client}"
        self._spawn(
            "master",
            [
                str(venv_bin / "mooncake_master"),
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={http}",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                f"--metrics_port={metrics}",
                "--enable_metric_reporting=false",
            ],
            env,
        )
        self._wait_port(rpc)
        self._wait_port(http)
        self._spawn(
            "client",
            [
                str(venv_bin / "mooncake_client"),
                "--host=127.0.0.1",
                f"--port={client}",
                f"--master_server_address={self.master}",
                f"--metadata_server={self.metadata}",
                f"--global_segment_size={SEGMENT_BYTES}",
                f"--local_buffer_size={64 << 20}",
                "--protocol=tcp",
            ],
            env,
        )
        self._wait_port(client)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.logdir / f"mooncake-{name}.log", "w")  # closed when the process is
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))

    def _wait_port(self, port: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a Mooncake process exited ({p.args[0]}): see {self.logdir}"
                    )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                time.sleep(0.5)  # the real client mounts its segment after it listens
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"Mooncake did not listen on {port} within {timeout} s")

    def run_case(self, kind: str, size: int, count: int, args: argparse.Namespace) -> list[dict]:
        argv = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--size",
            str(size),
            "--count",
            str(count),
            "--batches",
            args.batches,
            "--seconds",
            str(args.seconds),
            "--seed",
            str(args.seed),
            "--master",
            self.master,
            "--metadata",
            self.metadata,
            "--real-client",
            self.real_client,
        ]
        env = {**os.environ, **MOONCAKE_ENV}
        with open(self.logdir / f"{kind}-{size}.log", "w") as log:
            done = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True, timeout=300
            )
        if done.returncode != 0:
            tail = (self.logdir / f"{kind}-{size}.log").read_text()[-2000:]
            raise RuntimeError(f"{kind} {human(size)} failed ({done.returncode}): {tail}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


# ---------------------------------------------------------------- kvtier


def layout_for(size: int) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a bf16, 16-token block of `size` bytes."""
    per_layer = 2 * 16 * 8 * 128 * 2  # K and V, 16 tokens, 8 heads of 128 bf16: 64 KiB
    if size % per_layer == 0:
        return size // per_layer, 8, 128
    per_head = 2 * 16 * 128 * 2
    if size % per_head == 0 and size < per_layer:
        return 1, size // per_head, 128
    raise SystemExit(f"no bf16 16-token layout of {size} bytes")


class KvtierServer:
    def __init__(
        self,
        binary: Path,
        size: int,
        dram_bytes: int,
        workdir: Path,
        extra: tuple[str, ...] = (),
    ) -> None:
        """A kvtier-server on loopback; with `extra` settings (a cluster member's) its admin
        port is on too."""
        layers, heads, dim = layout_for(size)
        sets = [
            f'server.runtime_dir="{workdir / "run"}"',
            'server.tcp="127.0.0.1:0"',
            'server.quic="off"',
            'server.tls="off"',
            'server.admin="127.0.0.1:0"' if extra else 'server.admin="off"',
            f'server.token="{TOKEN}"',
            'store.tiers=["dram"]',
            'store.nvme_dir=""',
            f"store.dram_bytes={dram_bytes}",
            f"layout.layers={layers}",
            f"layout.kv_heads={heads}",
            f"layout.head_dim={dim}",
            'layout.dtype="bf16"',
            "layout.block_tokens=16",
            *extra,
        ]
        argv = [str(binary)]
        for s in sets:
            argv += ["--set", s]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["RUST_LOG"] = "warn"
        self.log = open(workdir / "kvtier-server.log", "w")  # closed in close()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        found: dict[str, str] = {}
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("listening ") and not ready.is_set():
                    found.update(kv.split("=", 1) for kv in line.split()[1:])
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60) or "unix" not in found:
            self.close()
            raise RuntimeError(f"kvtier-server did not start: see {workdir}/kvtier-server.log")
        self.unix_url = f"unix://{found['unix']}"
        self.tcp_url = f"tcp://{found['tcp']}"
        self.admin = found.get("admin", "off")

    def admin_json(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=10) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self.log.close()


def kvtier_cases(
    server: KvtierServer, size: int, count: int, batches: list[int], args: argparse.Namespace
) -> list[Result]:
    import kvtier

    vals = values(size, count, args.seed)
    # Random 16-byte keys (the engine's own hashes, as far as kvtier knows), stored as one
    # chain so any run of them is a cached prefix.
    rng = np.random.default_rng(args.seed + 1)
    keys = [rng.bytes(16) for _ in range(count)]
    writer = kvtier.Client(server.unix_url, timeout=30.0)
    parent = None
    for start in range(0, count, 64):
        stored = writer.put_chain(keys[start : start + 64], vals[start : start + 64], parent=parent)
        if stored.failure or stored.cached != len(keys[start : start + 64]):
            raise RuntimeError(f"kvtier put failed: {stored.failure} {stored.failure_detail}")
        parent = keys[min(start + 64, count) - 1]
    out = []
    max_batch = max(batches)
    dst = np.zeros((max_batch, size), dtype=np.uint8)
    for path, client in (
        ("kvtier unix", kvtier.Client(server.unix_url, timeout=30.0)),
        ("kvtier tcp", kvtier.Client(server.tcp_url, token=TOKEN, timeout=30.0)),
    ):
        if path == "kvtier unix" and not client.is_local:
            raise RuntimeError("the Unix client is not local (no zero-copy path)")
        for batch in batches:
            view = dst[:batch]

            def get(
                first: int,
                batch: int = batch,
                view: np.ndarray = view,
                c: kvtier.Client = client,
                path: str = path,
            ) -> None:
                got = c.get_into(keys[first : first + batch], view)
                if got.blocks != batch:
                    raise RuntimeError(f"{path}: {got.blocks} of {batch} ({got.miss_detail})")

            dst[:] = 0
            out.append(measure(path, size, batch, count, args.seconds, get, dst, vals))
    return out


class Etcd:
    """A one-member etcd on free loopback ports, its data in `workdir`."""

    def __init__(self, binary: str, workdir: Path) -> None:
        client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        argv = [
            binary,
            "--name=bench",
            f"--data-dir={workdir / 'etcd'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=bench={peer_url}",
        ]
        self.log = open(workdir / "etcd.log", "w")  # closed in close()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", client), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"etcd did not start: see {workdir}/etcd.log") from None
                time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.log.close()


def peer_metrics(admin: str) -> dict[str, float]:
    """Member `admin`'s counters of its requests to peer "a": the fetch rounds and the owner
    queries before them, with their summed seconds (kvtier_cluster_peer_request_seconds),
    and the block bytes fetched. With one-sided reads (`cluster.fetch` tcp or quic) a round
    is a "read" (one lookup's reads from "a", all its stripes, verified) and the query a
    "locate" (which pins the blocks there and carries their sums, hashed by the owner);
    over the protocol a round is a "fetch" (all its stripes, verified, the owner's hashing
    included) and the query a "lookup". Requests per stripe are not read here."""
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=10).read().decode()
    want = {
        ("kvtier_cluster_peer_request_seconds_sum", "fetch"): "fetch_s",
        ("kvtier_cluster_peer_request_seconds_count", "fetch"): "fetches",
        ("kvtier_cluster_peer_request_seconds_sum", "read"): "fetch_s",
        ("kvtier_cluster_peer_request_seconds_count", "read"): "fetches",
        ("kvtier_cluster_peer_request_seconds_sum", "lookup"): "lookup_s",
        ("kvtier_cluster_peer_request_seconds_count", "lookup"): "lookups",
        ("kvtier_cluster_peer_request_seconds_sum", "locate"): "lookup_s",
        ("kvtier_cluster_peer_request_seconds_count", "locate"): "lookups",
        ("kvtier_cluster_peer_fetched_bytes_total", None): "bytes",
        ("kvtier_cluster_remote_hits_total", None): "remote_hits",
    }
    out = dict.fromkeys(want.values(), 0.0)
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels.get("peer", "a") != "a":
            continue
        key = want.get((m.group(1), labels.get("op")))
        if key is not None:
            out[key] += float(m.group(3))
    return out


def peer_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """What member b's peer requests did between two `peer_metrics`: the fetches (count,
    bytes, mean time, and bytes over their summed time: the peer fetch's own GB/s, one fetch
    at a time as a lookup makes them), the owners' lookups or locates before them, and the
    GB/s over both together."""
    d = {k: after[k] - before[k] for k in before}
    both = d["fetch_s"] + d["lookup_s"]
    return {
        "fetches": int(d["fetches"]),
        "fetched_bytes": int(d["bytes"]),
        "fetch_gbps": d["bytes"] / d["fetch_s"] / 1e9 if d["fetch_s"] > 0 else 0.0,
        "fetch_mean_us": d["fetch_s"] / d["fetches"] * 1e6 if d["fetches"] else 0.0,
        "lookups": int(d["lookups"]),
        "lookup_mean_us": d["lookup_s"] / d["lookups"] * 1e6 if d["lookups"] else 0.0,
        "with_lookup_gbps": d["bytes"] / both / 1e9 if both > 0 else 0.0,
        "remote_hits": int(d["remote_hits"]),
    }


def kvtier_remote_cases(
    binary: Path,
    etcd: Etcd,
    size: int,
    count: int,
    batches: list[int],
    args: argparse.Namespace,
    workdir: Path,
) -> list[Result]:
    """The cluster's remote get (see the module's doc): two members, values on a, got on b."""
    import kvtier

    secret = workdir / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    members = []
    try:
        # b's DRAM is exactly a quarter of the values (no slack): cycling through all of them,
        # each call's values were evicted there since they last came.
        b_bytes = max(count // 4, 2 * max(batches)) * size
        for node, dram_bytes in (("a", 2 * count * size + (64 << 20)), ("b", b_bytes)):
            d = workdir / f"member-{node}"
            d.mkdir()
            extra = (
                f'cluster.etcd_endpoints="{etcd.url}"',
                f'cluster.node_id="{node}"',
                f'cluster.secret_file="{secret}"',
                "cluster.lease_ttl_s=5",
                # A 16-value batch of 2 MiB is 32 MiB from the peer: more than the default
                # 250 ms bound on a loaded 2-core machine.
                "cluster.peer_timeout_ms=5000",
                f'cluster.fetch="{args.fetch}"',
            )
            members.append(KvtierServer(binary, size, dram_bytes, d, extra))
        a, b = members
        deadline = time.monotonic() + 30
        while any(len(m.admin_json("/cluster").get("members", [])) < 2 for m in members):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the two members never saw each other: see {workdir}")
            time.sleep(0.2)
        if not b.admin_json("/cluster").get("data_path", {}).get("enabled"):
            raise RuntimeError("the cluster's data path is off on member b")
        vals = values(size, count, args.seed)
        # Keys a owns (each alone is its chain's first block, so its own anchor): a holds
        # every value as its owner and offers none to b.
        rng = np.random.default_rng(args.seed + 2)
        keys: list[bytes] = []
        while len(keys) < count:
            k = rng.bytes(16)
            if a.admin_json(f"/cluster?key={k.hex()}")["key"]["owners"][0] == "a":
                keys.append(k)
        writer = kvtier.Client(a.tcp_url, token=TOKEN, timeout=30.0)
        for i, k in enumerate(keys):
            stored = writer.put_chain([k], vals[i : i + 1])
            if stored.failure or stored.cached != 1:
                raise RuntimeError(f"kvtier put failed: {stored.failure} {stored.failure_detail}")
        dst = np.zeros((max(batches), size), dtype=np.uint8)
        out = []
        asked = 0
        short: dict[str, int] = {}
        for path, client in (
            # A worker beside member b (its Unix socket; b serves the fetched blocks zero-copy).
            ("kvtier remote", kvtier.Client(b.unix_url, timeout=30.0)),
            # A client of b over TCP: the bytes cross two TCP hops (a to b, b to the client).
            ("kvtier remote tcp", kvtier.Client(b.tcp_url, token=TOKEN, timeout=30.0)),
        ):
            for batch in batches:
                view = dst[:batch]

                def get(
                    first: int,
                    batch: int = batch,
                    view: np.ndarray = view,
                    c: kvtier.Client = client,
                    path: str = path,
                ) -> None:
                    nonlocal asked
                    ks = keys[first : first + batch]
                    # A lookup can come back short (see docs/benchmarks.md, "Against
                    # Mooncake Store"): then the call looks up the rest again, within its
                    # time, at most 3 tries; each short answer is counted.
                    done = 0
                    for _ in range(3):
                        found = len(c.lookup(ks[done:]).tiers)
                        got = c.get_into(ks[done:], view[done:])
                        asked += batch - done
                        done += min(found, got.blocks)
                        if done == batch:
                            return
                        short[path] = short.get(path, 0) + 1
                    raise RuntimeError(
                        f"{path}: {done} of {batch} after 3 lookups; logs in {workdir}"
                    )

                dst[:] = 0
                before = peer_metrics(b.admin)
                r = measure(path, size, batch, count, args.seconds, get, dst, vals)
                r.peer = peer_delta(before, peer_metrics(b.admin))
                out.append(r)
        remote = peer_metrics(b.admin)["remote_hits"]
        print(
            f"  {human(size):>7} kvtier remote: member b fetched {remote:.0f} blocks from a "
            f"of the {asked} its clients asked for; short lookups (asked again): {short or 0}",
            flush=True,
        )
        return out
    finally:
        for m in members:
            m.close()


def memcpy_cases(size: int, count: int, batches: list[int], args: argparse.Namespace) -> list:
    vals = values(size, count, args.seed)
    dst = np.zeros((max(batches), size), dtype=np.uint8)
    out = []
    for batch in batches:

        def get(first: int, batch: int = batch) -> None:
            np.copyto(dst[:batch], vals[first : first + batch])

        dst[:] = 0
        out.append(measure("memcpy", size, batch, count, args.seconds, get, dst, vals))
    return out


# ---------------------------------------------------------------- driver


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rust_figures(binary: str, sizes: list[int], seconds: float) -> str:
    argv = [
        binary,
        "tiers",
        "--parts",
        "server",
        "--server-tiers",
        "dram",
        "--transports",
        "unix,tcp",
        "--sizes",
        ",".join(f"{s >> 10}k" for s in sizes),
        "--clients",
        "1",
        "--seconds-per-case",
        str(seconds),
        "--lookup-blocks",
        "0",
        "--no-redis",
    ]
    print(f"\n== kvtier-bench (Rust SDK, same run): {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    return done.stdout + (done.stderr[-3000:] if done.returncode else "")


def transfer_figures(
    binary: str, sizes: list[int], batches: list[int], seconds: float
) -> list[dict]:
    """kvtier-transfer's TCP backend (READ, its defaults: 4 connections a peer) and the raw
    loopback TCP reference it measures with it, at the same sizes and batches: the reference
    for the cluster's peer fetch (issue 13 item 7)."""
    argv = [
        binary,
        "--json",
        "transfer",
        "--backends",
        "tcp",
        "--ops",
        "read",
        "--sizes",
        ",".join(f"{s >> 10}k" for s in sizes),
        "--batches",
        ",".join(str(b) for b in batches),
        "--seconds-per-case",
        str(seconds),
    ]
    print(f"\n== kvtier-transfer (same run): {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"kvtier-bench transfer failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)["result"]["cases"]


def peer_report(results: list[dict], transfer: list[dict]) -> None:
    """The cluster's peer fetch (member b's fetches from a during the "kvtier remote" cases)
    against kvtier-transfer's TCP backend and raw TCP (target >= 0.8x the backend)."""
    ref = {(c["block_bytes"], c["batch"]): c for c in transfer}
    print(
        "\n| size | batch | peer fetches | blocks a fetch | fetch mean us "
        "| owner lookup / locate mean us | peer fetch GB/s | with lookup / locate GB/s "
        "| kvtier-transfer tcp READ GB/s | raw TCP GB/s "
        "| peer fetch / transfer backend (target >= 0.8x) | with lookup / locate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p = r.get("peer")
        if r["path"] != "kvtier remote" or not p or not p["fetches"]:
            continue
        c = ref.get((r["size"], r["batch"]))
        blocks = p["fetched_bytes"] / r["size"] / p["fetches"]
        cells = (
            [f"{c['gb_per_s']:.2f}", f"{c['reference_gb_per_s']:.2f}"]
            if c
            else ["not run", "not run"]
        )
        ratio = p["fetch_gbps"] / c["gb_per_s"] if c and c["gb_per_s"] > 0 else None
        verdict = (
            "not run"
            if ratio is None
            else f"{ratio:.2f}x" + (": met" if ratio >= 0.8 else ": missed")
        )
        both = p["with_lookup_gbps"] / c["gb_per_s"] if c and c["gb_per_s"] > 0 else None
        print(
            f"| {human(r['size'])} | {r['batch']} | {p['fetches']:,} | {blocks:.1f} "
            f"| {p['fetch_mean_us']:,.1f} | {p['lookup_mean_us']:,.1f} | {p['fetch_gbps']:.2f} "
            f"| {p['with_lookup_gbps']:.2f} | {' | '.join(cells)} | {verdict} "
            f"| {'not run' if both is None else f'{both:.2f}x'} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="32k,256k,2m")
    p.add_argument("--batches", default="1,16", help="values a get call, comma-separated")
    p.add_argument("--working-set", default="128m", help="bytes of distinct values a size")
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds a case")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--server-bin", help="kvtier-server (release build)")
    p.add_argument("--kvtier-bench", help="also run `kvtier-bench tiers` (unix, tcp gets)")
    p.add_argument("--etcd", default=shutil.which("etcd"), help="etcd for the cluster case")
    p.add_argument("--no-cluster", action="store_true", help="skip the kvtier remote case")
    p.add_argument(
        "--fetch",
        default="tcp",
        choices=["tcp", "quic", "protocol"],
        help="how member b gets a's blocks (cluster.fetch): a one-sided read over "
        "kvtier-transfer's tcp or quic backend, or a fetch over the kvtier protocol",
    )
    p.add_argument("--json", help="write every result here")
    p.add_argument("--keep-logs", action="store_true")
    # A Mooncake case's own process (internal).
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--metadata", help=argparse.SUPPRESS)
    p.add_argument("--real-client", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mooncake_child(args)
        return
    if not args.server_bin:
        raise SystemExit("--server-bin is required (a release kvtier-server)")
    if not args.no_cluster and not args.etcd:
        raise SystemExit("no etcd for the cluster case (.ci/install-deps; or --no-cluster)")

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    ws = parse_size(args.working_set)
    start_load = loadavg()
    print(
        f"load average at start: {start_load}; sizes {args.sizes}, batches {args.batches}, "
        f"working set {human(ws)} a size, {args.seconds} s a case, seed {args.seed}",
        flush=True,
    )
    logdir = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    results: list[dict] = []
    mooncake = Mooncake(Path(sys.executable).parent, logdir)
    etcd = None if args.no_cluster else Etcd(args.etcd, logdir)
    try:
        for size in sizes:
            count = max(ws // size, 2 * max(batches))
            case: list[dict] = []
            case += [r.as_json() for r in memcpy_cases(size, count, batches, args)]
            for kind in ("mooncake-tcp", "mooncake-shm"):
                case += mooncake.run_case(kind, size, count, args)
            workdir = logdir / f"kvtier-{size}"
            workdir.mkdir()
            server = KvtierServer(
                Path(args.server_bin), size, 2 * count * size + (64 << 20), workdir
            )
            try:
                case += [r.as_json() for r in kvtier_cases(server, size, count, batches, args)]
            finally:
                server.close()
            if etcd is not None:
                workdir = logdir / f"kvtier-remote-{size}"
                workdir.mkdir()
                case += [
                    r.as_json()
                    for r in kvtier_remote_cases(
                        Path(args.server_bin), etcd, size, count, batches, args, workdir
                    )
                ]
            for r in case:
                print(
                    f"  {human(size):>7} batch {r['batch']:>2} {r['path']:<13} "
                    f"{r['gbps']:6.2f} GB/s  p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us"
                    f"  ({r['ops']} calls, wrong {r['wrong']})",
                    flush=True,
                )
            results += case
    finally:
        mooncake.close()
        if etcd is not None:
            etcd.close()
    end_load = loadavg()
    report(results, sizes, batches)
    wrong = sum(r["wrong"] for r in results)
    print(f"\nwrong values: {wrong}; load average at start {start_load}, at end {end_load}")
    transfer: list[dict] = []
    if args.kvtier_bench:
        print(rust_figures(args.kvtier_bench, sizes, args.seconds))
        transfer = transfer_figures(args.kvtier_bench, sizes, batches, args.seconds)
        print(f"load average after kvtier-bench: {loadavg()}")
    if etcd is not None:
        peer_report(results, transfer)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "start_load": start_load,
                    "end_load": end_load,
                    "results": results,
                    "transfer": transfer,
                },
                indent=1,
            )
        )
    if args.keep_logs:
        print(f"logs: {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    if wrong:
        raise SystemExit(1)


def report(results: list[dict], sizes: list[int], batches: list[int]) -> None:
    """GB/s is bytes over the summed call times (a mean: the load's tails weigh in); "GB/s at
    p50" is a call's bytes over its median time, steadier on a loaded machine."""
    by = {(r["path"], r["size"], r["batch"]): r for r in results}

    def p50_gbps(r: dict) -> float:
        return r["size"] * r["batch"] / (r["p50_us"] * 1e3)

    print("\n| size | batch | path | GB/s | GB/s at p50 | p50 / p99 us | x memcpy (mean, p50) |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        for batch in batches:
            ref = by[("memcpy", size, batch)]
            for path in PATHS:
                r = by.get((path, size, batch))
                if r is None:
                    continue
                print(
                    f"| {human(size)} | {batch} | {path} | {r['gbps']:.2f} | {p50_gbps(r):.2f} | "
                    f"{r['p50_us']:,.1f} / {r['p99_us']:,.1f} | {r['gbps'] / ref['gbps']:.2f}x, "
                    f"{p50_gbps(r) / p50_gbps(ref):.2f}x |"
                )
    print(
        "\n| size | batch | kvtier unix / mooncake shm, mean and p50 (target >= 2x) "
        "| kvtier remote / mooncake tcp, mean and p50 (target >= 2x) "
        "| kvtier remote tcp / mooncake tcp, mean and p50 "
        "| kvtier tcp / mooncake tcp, mean and p50 (a local get, for reference) |"
    )
    print("|---|---|---|---|---|---|")
    for size in sizes:
        for batch in batches:
            cells = []
            for ours, theirs in (
                ("kvtier unix", "mooncake shm"),
                ("kvtier remote", "mooncake tcp"),
                ("kvtier remote tcp", "mooncake tcp"),
                ("kvtier tcp", "mooncake tcp"),
            ):
                if (ours, size, batch) not in by:
                    cells.append("not run")
                    continue
                a, b = by[(ours, size, batch)], by[(theirs, size, batch)]
                mean, med = a["gbps"] / b["gbps"], p50_gbps(a) / p50_gbps(b)
                verdict = {(True, True): "met", (False, True): "met at p50 only"}.get(
                    (mean >= 2, med >= 2), "missed" if med < 2 and mean < 2 else "met in mean only"
                )
                cells.append(f"{mean:.2f}x, {med:.2f}x: {verdict}")
            print(f"| {human(size)} | {batch} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
