"""Independent references for the converted SmolLM2 model: a float32 numpy Llama forward and a
byte-level BPE tokenizer built straight from the GGUF's vocabulary and merges.

Neither uses torch, transformers, `tokenizers` or vLLM, so they can check all of those. Used by
scripts/verify-model.py and scripts/tests/test_model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------
# Weights


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read a float32 safetensors file (as fetch-model.py writes it) into numpy arrays, mapped."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{name}: dtype {info['dtype']}, this reader takes F32 only")
        begin, end = info["data_offsets"]
        out[name] = data[begin:end].view(np.float32).reshape(info["shape"])
    return out


# ---------------------------------------------------------------------------------------------
# Forward


class LlamaNumpy:
    """Hugging Face's LlamaForCausalLM in float32 numpy: RMSNorm, rotary embeddings in the
    rotate_half convention, grouped-query attention, SwiGLU MLP, tied or separate LM head.
    One sequence at a time, with a KV cache for greedy decoding."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = load_safetensors(model_dir / "model.safetensors")
        c = self.cfg
        self.n_layer = c["num_hidden_layers"]
        self.n_head = c["num_attention_heads"]
        self.n_kv = c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_head
        self.eps = float(c["rms_norm_eps"])
        self.theta = float(c["rope_theta"])
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.embed if c.get("tie_word_embeddings") else self.w["lm_head.weight"]
        d = self.head_dim
        self.inv_freq = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        self.reset()

    def reset(self) -> None:
        self.k_cache = [
            np.zeros((0, self.n_kv, self.head_dim), np.float32) for _ in range(self.n_layer)
        ]
        self.v_cache = [
            np.zeros((0, self.n_kv, self.head_dim), np.float32) for _ in range(self.n_layer)
        ]

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(var + self.eps)).astype(np.float32) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # x: (T, heads, d). emb = cat(freqs, freqs); x * cos + rotate_half(x) * sin.
        freqs = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos = np.cos(emb).astype(np.float32)[:, None, :]
        sin = np.sin(emb).astype(np.float32)[:, None, :]
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def forward(self, ids: list[int]) -> np.ndarray:
        """Append `ids` to the cached sequence; return their logits, (len(ids), vocab) float32."""
        start = self.k_cache[0].shape[0]
        t = len(ids)
        pos = np.arange(start, start + t)
        x = self.embed[np.asarray(ids)].astype(np.float32)
        group = self.n_head // self.n_kv
        scale = np.float32(1.0 / np.sqrt(self.head_dim))
        # Causal mask over (new tokens) x (cached + new tokens).
        mask = np.arange(start + t)[None, :] > pos[:, None]
        for i in range(self.n_layer):
            p = f"model.layers.{i}."
            h = self._rms(x, self.w[p + "input_layernorm.weight"])
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).reshape(t, self.n_head, self.head_dim)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).reshape(t, self.n_kv, self.head_dim)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).reshape(t, self.n_kv, self.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.k_cache[i] = np.concatenate([self.k_cache[i], k])
            self.v_cache[i] = np.concatenate([self.v_cache[i], v])
            ks = np.repeat(
                self.k_cache[i], group, axis=1
            )  # (S, n_head, d): head j uses kv j // group
            vs = np.repeat(self.v_cache[i], group, axis=1)
            scores = np.einsum("thd,shd->hts", q, ks) * scale
            scores = np.where(mask[None], np.float32(-np.inf), scores)
            scores = scores - scores.max(-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", probs, vs).reshape(t, self.n_head * self.head_dim)
            x = x + attn @ self.w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, self.w[p + "post_attention_layernorm.weight"])
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ self.w[p + "mlp.down_proj.weight"].T
        x = self._rms(x, self.w["model.norm.weight"])
        return (x @ self.lm_head.T).astype(np.float32)

    def greedy(self, ids: list[int], max_tokens: int, eos: int | None = None):
        """Greedy continuation of `ids`: (generated ids, logits of each generated step)."""
        self.reset()
        logits = self.forward(ids)[-1]
        out, steps = [], []
        for _ in range(max_tokens):
            steps.append(logits)
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if nxt == eos:
                break
            logits = self.forward([nxt])[-1]
        return out, steps


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Tokenizer from the GGUF


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE's alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class GgufBpe:
    """Byte-level BPE straight from a GGUF's tokenizer.ggml.* fields, pre-tokenized the way
    llama.cpp does for tokenizer.ggml.pre = "smollm" (each digit alone, then GPT-2's regex).
    No special-token parsing: for plain text only. Adds no BOS (the GGUF says add_bos_token
    false; the caller checks that)."""

    GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, gguf_path: Path):
        import regex  # vLLM's dependency; the `re` module lacks \p{...}
        from gguf import GGUFReader

        r = GGUFReader(str(gguf_path))
        self.fields = {k: r.fields[k] for k in r.fields if k.startswith("tokenizer.")}
        self.pre = str(self.fields["tokenizer.ggml.pre"].contents())
        if self.pre != "smollm":
            raise ValueError(f"pre-tokenizer {self.pre!r} not handled by this reference")
        self.add_bos = bool(self.fields["tokenizer.ggml.add_bos_token"].contents())
        tokens = self.fields["tokenizer.ggml.tokens"].contents()
        self.vocab = {t: i for i, t in enumerate(tokens)}
        merges = self.fields["tokenizer.ggml.merges"].contents()
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.byte_map = _bytes_to_unicode()
        self.digit = regex.compile(r"\p{N}")
        self.gpt2 = regex.compile(self.GPT2)

    def _split(self, pattern, pieces: list[str]) -> list[str]:
        out = []
        for piece in pieces:
            last = 0
            for m in pattern.finditer(piece):
                if m.start() > last:
                    out.append(piece[last : m.start()])
                out.append(m.group(0))
                last = m.end()
            if last < len(piece):
                out.append(piece[last:])
        return out

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            best = min(
                range(len(parts) - 1),
                key=lambda j: self.ranks.get((parts[j], parts[j + 1]), 1 << 30),
            )
            if (parts[best], parts[best + 1]) not in self.ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._split(self.gpt2, self._split(self.digit, [text])):
            word = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.vocab[p] for p in self._bpe(word))
        return ids
