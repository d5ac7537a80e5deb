#!/usr/bin/env python3
"""``kvtier-bench agentic`` through kvtier-router in front of ``vllm serve`` workers with kvtier's
connector, one fleet per routing policy, in one run; docs/benchmarks.md.

    "$(scripts/vllm-env.sh)/bin/python" scripts/bench-vllm-router.py \\
        [--policies kv,round_robin] [--workers 2] [--blocks 64] [--max-model-len 4096] \\
        [--bench target/release/kvtier-bench] [--router target/release/kvtier-router] \\
        [-- agentic args...]

Per policy, one after the other (so only one fleet's processes share the CPUs), a fleet of
``--workers`` workers, each a ``vllm serve`` (SmolLM2-135M, bfloat16, vLLM's prefix cache on,
its KV space capped at ``--blocks`` 128-token blocks, contexts of at most ``--max-model-len``
tokens) with the connector over its own fresh kvtier-server's Unix socket, and a
``kvtier-router --engine vllm --policy P`` in front; ``kvtier-bench agentic`` drives the same
seeded workload through the router (arguments after ``--`` go to it; ``--max-context`` is set
to ``--max-model-len`` unless given). After each: the router's requests per worker, placements
and mismatch counters, each vLLM's metrics summary and each connector's counters. The load
average is printed before and after each run.
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
    BLOCK,
    REPO,
    ApiServer,
    KvtierServer,
    Router,
    connector_config,
    free_dir,
    model_dir,
    remove,
    vllm_time_spent,
)


def fleet_run(
    policy: str, args: argparse.Namespace, model: Path, work: Path, agentic: list[str]
) -> int:
    """One fleet (fresh kvtier-servers, vLLMs and router) driven by ``kvtier-bench agentic``."""
    kvs: list[KvtierServer] = []
    apis: list[ApiServer] = []
    router: Router | None = None
    cap = [
        "--max-num-seqs", "8", "--num-gpu-blocks-override", str(args.blocks),
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    try:
        for i in range(args.workers):
            srv = KvtierServer(work / f"{policy}-{i}", dram="1GiB", nvme="2GiB")
            srv.start()
            kvs.append(srv)
            kv = connector_config(srv.url, {"stats_file": str(work / f"{policy}-{i}.stats")})
            apis.append(ApiServer(model, cap, kv, max_model_len=args.max_model_len))
        for api in apis:
            api.wait_healthy()
        workers = [
            f for a, s in zip(apis, kvs, strict=True) for f in ("--worker", f"{a.base},kvtier={s.url}")
        ]  # fmt: skip
        router = Router(
            [
                "--engine",
                "vllm",
                "--policy",
                policy,
                "--model-dir",
                str(model),
                "--model-name",
                "smollm2",
                "--kv-model-id",
                str(model),
                "--kv-dtype",
                "bf16",
                "--block-tokens",
                str(BLOCK),
                *workers,
            ]  # fmt: skip
        )
        cmd = [args.bench, "agentic", "--model", "smollm2", "--target", f"{policy}={router.base}"]
        cmd += agentic
        print("$", " ".join(cmd), flush=True)
        print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
        code = subprocess.run(cmd, check=False).returncode
        print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
        per = [router.metric("kvtier_router_routed_total", worker=a.base) for a in apis]
        print(f"{policy}: requests per worker {per}", flush=True)
        for what in ("placements_total", "cache_mismatch_total", "key_mismatch_suspected"):
            print(f"{policy}: kvtier_router_{what} {router.metric('kvtier_router_' + what)}")
        for i, a in enumerate(apis):
            try:
                print(f"{policy}: vLLM {i}: {vllm_time_spent(a.base)}", flush=True)
            except OSError as e:
                print(f"{policy}: vLLM {i}: metrics unavailable: {e}", flush=True)
            for side in ("scheduler", "worker"):
                stats = work / f"{policy}-{i}.stats.{side}.json"
                if stats.exists():
                    print(f"{policy}: connector {i} ({side}): {stats.read_text()}", flush=True)
        return code
    finally:
        if router is not None:
            router.stop()
        for a in apis:
            a.stop()
        for s in kvs:
            s.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="kv,round_robin")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=64, help="vLLM's KV blocks (128 tokens each)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--bench", default=str(REPO / "target" / "release" / "kvtier-bench"))
    ap.add_argument("--router", default=str(REPO / "target" / "release" / "kvtier-router"))
    ap.add_argument("agentic", nargs="*", help="kvtier-bench agentic arguments (after --)")
    args = ap.parse_args()
    os.environ["KVTIER_ROUTER_BIN"] = args.router
    model = model_dir()
    agentic = args.agentic or AGENTIC_DEFAULT
    if "--max-context" not in agentic:
        agentic = [*agentic, "--max-context", str(args.max_model_len)]
    work = free_dir("kvtier-vllm-router-bench-")
    try:
        codes = [fleet_run(p, args, model, work, agentic) for p in args.policies.split(",") if p]
        return max(codes, default=0)
    finally:
        remove(work)


if __name__ == "__main__":
    sys.exit(main())
