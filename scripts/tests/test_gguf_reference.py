"""kvtier-worker on the quantized GGUF checked against an independent float32 reference.

The worker loads SmolLM2's Q4_1 GGUF with its weights kept quantized (tokenizer from the GGUF's
metadata) and generates greedily with every step's logits (worker/examples/greedy_logits.rs).
scripts/model_reference.py's numpy forward runs the dequantized weights of the same GGUF (the
Hugging Face directory scripts/fetch-model.py converts) over the worker's tokens. Checked per
prompt: the prompt's ids equal the reference byte-level BPE's, every greedy token is the
reference's argmax, and every logit is within LOGIT_TOLERANCE of the reference's.

Needs gguf, numpy, regex and pytest (no vLLM, no torch; scripts/ref-env.sh makes that venv) and
cargo:
    "$(scripts/ref-env.sh)/bin/python" -m pytest scripts/tests/test_gguf_reference.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1]
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

from model_reference import GgufBpe, LlamaNumpy  # noqa: E402 (after the sys.path line above)

STEPS = 12
# The worker's decode steps and its prefill GEMM round activations to 16 bits per 32-value
# block (llama.cpp and candle round them to 8 bits), and its prefill attention rounds queries,
# keys, values and weights to 13-14 bits where the CPU has AVX-512 VNNI; the reference computes
# everything in float32. Largest difference measured over these prompts: 0.0215 (0.0077 with
# the f32 attention; docs/worker.md).
LOGIT_TOLERANCE = 0.05
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The three primary colors are",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "The Pacific Ocean is",
    "My favourite book is",
    "In 1969, the first humans",
    "The quick brown fox",
    "A healthy breakfast includes",
    "The main difference between a cat and a dog is",
    "Python is a programming language that",
    "The sun rises in the",
    "Shakespeare wrote",
    "2 + 2 =",
    "The best way to learn a new language is",
    "Mount Everest is located in",
    # Two prompts past the worker's 32-token threshold, so its prefill GEMM and blocked
    # attention (not the decode kernel) compute their prompt.
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used for wine. Within fifty years printers worked in more than two hundred cities, "
    "and the number of books in Europe",
    "Here is a short Python function that reads a CSV file, skips the header line, and returns "
    "the sum of the values in its third column as a float:\n\nimport csv\n\ndef "
    "third_column_sum(path):\n",
    # A long prompt (about 700 tokens): past a 512-token prefill chunk, so the attention runs
    # over many blocks of cached keys as well as the chunk's own.
    " ".join(
        f"Chapter {n}. The harbour town of {town} grew around its fish market, its rope walk and "
        f"a customs house built of {stone}. Ships brought {cargo} from the south, and in winter "
        f"the merchants met in the long room above the market to settle their accounts."
        for n, (town, stone, cargo) in enumerate(
            [
                ("Arlen", "grey granite", "salt and wine"),
                ("Bressay", "red sandstone", "timber and tar"),
                ("Calder", "yellow limestone", "wool and hides"),
                ("Dunmore", "black basalt", "copper and tin"),
                ("Elgin", "white marble", "spices and silk"),
                ("Fenwick", "brown brick", "grain and flour"),
                ("Garth", "blue slate", "coal and iron"),
                ("Hollin", "pale chalk", "oil and soap"),
                ("Islay", "green serpentine", "tea and sugar"),
                ("Jura", "pink granite", "cotton and dye"),
                ("Kelso", "grey flint", "glass and lead"),
                ("Lerwick", "old oak", "herring and barrels"),
            ],
            start=1,
        )
    )
    + " In the last chapter the historian asks which of these towns",
]


@pytest.fixture(scope="module")
def worker_run(gguf_path: Path, tmp_path_factory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("logits")
    # KVTIER_CARGO_ARGS: extra cargo arguments, e.g. "--release --features kvtier-transfer/ucx"
    # (.ci/run: reuse its release build; the dev profile's kernel runs far slower).
    extra = os.environ.get("KVTIER_CARGO_ARGS", "").split()
    cmd = ["cargo", "run", "-q", *extra, "-p", "kvtier-worker", "--example", "greedy_logits", "--"]
    run = subprocess.run(
        [*cmd, str(gguf_path), str(STEPS), str(out)],
        input="".join(json.dumps(p) + "\n" for p in PROMPTS),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(PROMPTS), run.stdout
    return results, out


def test_worker_matches_the_float32_reference(model_dir, gguf_path, worker_run) -> None:
    results, out = worker_run
    bpe = GgufBpe(gguf_path)
    ref = LlamaNumpy(model_dir)
    vocab = ref.embed.shape[0]
    worst, failures = 0.0, []
    for i, (text, got) in enumerate(zip(PROMPTS, results, strict=True)):
        assert got["prompt"] == bpe.encode(text), f"prompt {i} tokenized differently: {text!r}"
        logits = np.fromfile(out / f"{i}.f32", dtype="<f4").reshape(STEPS, vocab)
        ref.reset()
        want = ref.forward(got["prompt"])[-1]
        for s, token in enumerate(got["tokens"]):
            diff = float(np.abs(logits[s] - want).max())
            worst = max(worst, diff)
            top2 = np.sort(want)[-2:]
            if int(np.argmax(want)) != token or diff > LOGIT_TOLERANCE:
                failures.append(
                    f"prompt {i} step {s}: worker {token}, reference {int(np.argmax(want))} "
                    f"(reference top-2 gap {top2[1] - top2[0]:.4f}), max |logit diff| {diff:.4f}"
                )
            want = ref.forward([token])[-1]
    print(f"largest |logit difference| over {len(PROMPTS)} prompts x {STEPS} steps: {worst:.4f}")
    assert not failures, "\n".join(failures)
