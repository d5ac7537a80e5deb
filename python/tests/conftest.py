"""Fixtures: a real kvtier-server binary on a temporary Unix socket and loopback TCP/QUIC
ports, stopped at teardown.

The binary comes from $KVTIER_PY_SERVER_BIN, else from the workspace's target directory (built
with ``cargo build -p kvtier-server`` when missing there).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvtier

TOKEN = "pytest-secret-token"
# 1 layer x 4 kv heads x 16 dims x f16 x 16 tokens: 4 KiB blocks.
LAYOUT = ("f16", 1, 4, 16, 16)
BLOCK = 4096
REPO = Path(__file__).resolve().parents[2]


def server_binary() -> Path:
    env = os.environ.get("KVTIER_PY_SERVER_BIN")
    if env:
        return Path(env)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    target = Path(json.loads(meta.stdout)["target_directory"])
    binary = target / "debug" / "kvtier-server"
    if not binary.exists():
        subprocess.run(["cargo", "build", "-p", "kvtier-server"], cwd=REPO, check=True)
    return binary


@dataclass
class Server:
    proc: subprocess.Popen
    dir: Path
    unix: str
    tcp: str
    quic: str
    tls: str

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix}"

    @property
    def tcp_url(self) -> str:
        return f"tcp://{self.tcp}"

    @property
    def tls_url(self) -> str:
        return f"tls://{self.tls}"

    @property
    def quic_url(self) -> str:
        return f"quic://{self.quic}"

    @property
    def quic_cert(self) -> Path:
        """The generated certificate QUIC and TLS present (named for QUIC, which had it first)."""
        return self.dir / "run" / "quic-cert.der"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=15)


def start_server(directory: Path, extra: Sequence[str] = ()) -> Server:
    """A server in `directory`; `extra` are more `--set` assignments (they win)."""
    dtype, layers, heads, dim, _ = LAYOUT
    sets = [
        f'server.runtime_dir="{directory / "run"}"',
        'server.tcp="127.0.0.1:0"',
        'server.quic="127.0.0.1:0"',
        'server.tls="127.0.0.1:0"',
        'server.admin="127.0.0.1:0"',
        f'server.token="{TOKEN}"',
        'store.dram_bytes="4MiB"',
        "store.dram_prefault=false",
        f'store.nvme_dir="{directory / "nvme"}"',
        'store.nvme_bytes="8MiB"',
        "store.io_threads=2",
        f"layout.layers={layers}",
        f"layout.kv_heads={heads}",
        f"layout.head_dim={dim}",
        f'layout.dtype="{dtype}"',
        *extra,
    ]
    args = [str(server_binary())]
    for s in sets:
        args += ["--set", s]
    # The server reads KVTIER_<SECTION>_<KEY> settings from its environment: give it none.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["RUST_LOG"] = "warn"
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("listening ") and not ready.is_set():
                found.update(kv.split("=", 1) for kv in line.split()[1:])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(30) or not found:
        proc.kill()
        proc.wait(timeout=15)
        raise RuntimeError("kvtier-server did not report its endpoints within 30 s")
    return Server(proc, directory, found["unix"], found["tcp"], found["quic"], found["tls"])


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    directory = Path(tempfile.mkdtemp(prefix="kvtier-pytest-"))
    try:
        srv = start_server(directory)
        try:
            yield srv
        finally:
            code = srv.stop()
        assert code == 0, f"kvtier-server exited with {code}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def unix_client(server: Server) -> kvtier.Client:
    return kvtier.Client(server.unix_url, timeout=5.0)


@pytest.fixture
def tcp_client(server: Server) -> kvtier.Client:
    return kvtier.Client(server.tcp_url, token=TOKEN, timeout=5.0)


_counter = iter(range(1, 1 << 30))


def fresh_keys(n: int) -> list[bytes]:
    """Keys of a prompt no other test uses (each call hashes new tokens)."""
    secret = kvtier.HashSecret.development()
    ns = kvtier.NamespaceBuilder("pytest-model", kvtier.KvLayout(1, 4, 16, "f16", 16))
    hasher = kvtier.PrefixHasher(secret, ns, 16)
    base = next(_counter) * 100_000
    return hasher.prompt_keys(range(base, base + 16 * n))
