#!/usr/bin/env python3
"""``kvtier-bench agentic`` against ``vllm serve`` with and without kvtier, on a vLLM whose own
KV space is smaller than the workload's working set (as on a busy server); docs/benchmarks.md.

    "$(scripts/vllm-env.sh)/bin/python" scripts/bench-vllm-agentic.py \\
        [--blocks 64] [--bench target/release/kvtier-bench] [-- agentic args...]

Two ``vllm serve`` processes (SmolLM2-135M, bfloat16, vLLM's prefix cache on in both, KV space
capped at ``--blocks`` 128-token blocks with ``--num-gpu-blocks-override``): ``vllm`` alone and
``vllm+kvtier`` (the connector, over a kvtier-server's Unix socket). Both are up for the whole
run; ``kvtier-bench agentic`` drives the same seeded workload against one after the other and
prints them side by side (arguments after ``--`` go to it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

from vllm_harness import REPO, KvtierServer, free_dir, remove  # noqa: E402

DEFAULT_AGENTIC = [
    "--sessions", "8", "--concurrency", "4", "--turns-min", "4", "--turns-max", "8",
    "--harness-tokens", "1024", "--task-tokens", "256", "--tool-tokens", "192",
    "--output-tokens", "32", "--time-scale", "0.05", "--subagent-prob", "0",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, port: int, blocks: int, kv: dict | None) -> subprocess.Popen:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "2",
    }
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager",
        "--max-num-seqs", "8", "--num-gpu-blocks-override", str(blocks),
    ]  # fmt: skip
    if kv:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return subprocess.Popen(args, env=env, stdout=sys.stderr, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("vllm serve did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="vLLM's KV blocks (128 tokens each)")
    ap.add_argument("--bench", default=str(REPO / "target" / "release" / "kvtier-bench"))
    ap.add_argument("agentic", nargs="*", help="kvtier-bench agentic arguments (after --)")
    args = ap.parse_args()
    model = Path(
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "fetch-model.py"), "--print-dir"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    work = free_dir("kvtier-vllm-agentic-")
    srv = KvtierServer(work / "kvtier", dram="2GiB", nvme="8GiB")
    procs: list[subprocess.Popen] = []
    try:
        srv.start()
        kv = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": srv.url, "stats_file": str(work / "serve")},
        }
        p_off, p_on = free_port(), free_port()
        procs.append(serve(model, p_off, args.blocks, None))
        wait_healthy(procs[-1], p_off)
        procs.append(serve(model, p_on, args.blocks, kv))
        wait_healthy(procs[-1], p_on)
        cmd = [
            args.bench, "agentic", "--model", "smollm2",
            "--target", f"vllm=http://127.0.0.1:{p_off}",
            "--target", f"vllm+kvtier=http://127.0.0.1:{p_on}",
            *(args.agentic or DEFAULT_AGENTIC),
        ]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        code = subprocess.run(cmd, check=False).returncode
        stats = work / "serve.worker.json"
        if stats.exists():
            print("kvtier connector (worker):", stats.read_text(), flush=True)
        return code
    finally:
        for p in procs:
            stop(p)
        srv.kill()
        remove(work)


if __name__ == "__main__":
    sys.exit(main())
