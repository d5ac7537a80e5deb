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
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

from vllm_harness import (  # noqa: E402
    AGENTIC_DEFAULT,
    REPO,
    ApiServer,
    KvtierServer,
    connector_config,
    free_dir,
    model_dir,
    remove,
    vllm_time_spent,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="vLLM's KV blocks (128 tokens each)")
    ap.add_argument(
        "--max-model-len", type=int, default=4096, help="vLLM's context (SmolLM2: up to 8,192)"
    )
    ap.add_argument("--bench", default=str(REPO / "target" / "release" / "kvtier-bench"))
    ap.add_argument("agentic", nargs="*", help="kvtier-bench agentic arguments (after --)")
    args = ap.parse_args()
    model = model_dir()
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
        agentic = args.agentic or AGENTIC_DEFAULT
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
                print(f"vLLM metrics ({name}):", vllm_time_spent(api.base), flush=True)
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
