#!/usr/bin/env python3
"""``kvtier-bench agentic`` against ``vllm serve`` with and without kvtier, on a vLLM whose own
KV space is smaller than the workload's working set (as on a busy server); docs/benchmarks.md.

    "$(scripts/vllm-env.sh)/bin/python" scripts/bench-vllm-agentic.py \\
        [--blocks 64] [--max-model-len 4096] [--bench target/release/kvtier-bench] \\
        [-- agentic args...]

Two ``vllm serve`` processes (SmolLM2-135M, bfloat16, vLLM's prefix cache on in both, KV space
capped at ``--blocks`` 128-token blocks with ``--num-gpu-blocks-override``, contexts of at most
``--max-model-len`` tokens): ``vllm`` alone and ``vllm+kvtier`` (the connector, over a
kvtier-server's Unix socket). Both are up for the whole run; ``kvtier-bench agentic`` drives the
same seeded workload against one after the other and prints them side by side (arguments after
``--`` go to it; ``--max-context`` is set to ``--max-model-len`` unless given there). The load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

from vllm_harness import (  # noqa: E402
    REPO,
    ApiServer,
    KvtierServer,
    connector_config,
    free_dir,
    remove,
)

DEFAULT_AGENTIC = [
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


def time_spent(base: str) -> dict[str, float]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="vLLM's KV blocks (128 tokens each)")
    ap.add_argument(
        "--max-model-len", type=int, default=4096, help="vLLM's context (SmolLM2: up to 8,192)"
    )
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
    servers: list[ApiServer] = []
    try:
        srv.start()
        kv = connector_config(srv.url, {"stats_file": str(work / "serve")})
        cap = ["--max-num-seqs", "8", "--num-gpu-blocks-override", str(args.blocks)]
        for config in (None, kv):
            servers.append(ApiServer(model, cap, config, max_model_len=args.max_model_len))
            servers[-1].wait_healthy()
        off, on = servers
        agentic = args.agentic or DEFAULT_AGENTIC
        if "--max-context" not in agentic:
            # A session ends where its next prompt would not fit vLLM's context.
            agentic = [*agentic, "--max-context", str(args.max_model_len)]
        cmd = [
            args.bench, "agentic", "--model", "smollm2",
            "--target", f"vllm={off.base}",
            "--target", f"vllm+kvtier={on.base}",
            *agentic,
        ]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
        code = subprocess.run(cmd, check=False).returncode
        print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
        for name, api in (("vllm", off), ("vllm+kvtier", on)):
            try:
                print(f"vLLM metrics ({name}):", time_spent(api.base), flush=True)
            except OSError as e:
                print(f"vLLM metrics ({name}): unavailable: {e}", flush=True)
        for side in ("scheduler", "worker"):
            stats = work / f"serve.{side}.json"
            if stats.exists():
                print(f"kvtier connector ({side}):", stats.read_text(), flush=True)
        return code
    finally:
        for api in servers:
            api.stop()
        srv.kill()
        remove(work)


if __name__ == "__main__":
    sys.exit(main())
