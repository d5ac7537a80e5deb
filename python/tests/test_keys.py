"""Block keys, namespaces and layouts: the same values as kvtier-core's golden tests
(core/src/key.rs `golden_keys_xxh3`, `golden_keys_blake3`, `golden_namespace_encoding`;
core/src/layout.rs `golden_fingerprint`), so Python and Rust make the same keys."""

from __future__ import annotations

import pytest

import kvtier

GOLDEN_SECRET = b"golden-test-secret-0123456789abcdef"
GOLDEN_XXH3 = ["ea8f9de2b720cb864bfbc95c22eedc25", "64d75a499fb0df995a972af8e2e3cd39"]
GOLDEN_BLAKE3 = ["6e41880d5d5f1e18e4472f78f58fc703", "bfae33da89e23a3335d1f8f785031ab2"]
GOLDEN_FINGERPRINT = 0xB84A5B8B8D9500BE


def golden_hasher(scheme: str) -> kvtier.PrefixHasher:
    secret = kvtier.HashSecret(GOLDEN_SECRET, scheme)
    ns = kvtier.NamespaceBuilder("llama-3-8b", 0x0123_4567_89AB_CDEF)
    return kvtier.PrefixHasher(secret, ns, 4)


@pytest.mark.parametrize(("scheme", "want"), [("xxh3", GOLDEN_XXH3), ("blake3", GOLDEN_BLAKE3)])
def test_golden_keys_match_kvtier_core(scheme: str, want: list[str]) -> None:
    keys = golden_hasher(scheme).prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [k.hex() for k in keys] == want


def test_block_key_chains_like_prompt_keys() -> None:
    h = golden_hasher("xxh3")
    first = h.block_key(None, [1, 2, 3, 4])
    second = h.block_key(first, [5, 6, 7, 8])
    assert [first.hex(), second.hex()] == GOLDEN_XXH3


def test_golden_layout_fingerprint() -> None:
    layout = kvtier.KvLayout(32, 8, 128, "bf16", 16)
    assert layout.fingerprint == GOLDEN_FINGERPRINT
    assert layout.block_bytes == 2 << 20
    assert layout.layer_bytes == 64 << 10
    assert layout.tensor_range(0, "v") == (32768, 65536)
    assert layout.layer_range(31) == ((2 << 20) - (64 << 10), 2 << 20)
    assert kvtier.KvLayout(32, 8, 128, "f16", 16).fingerprint != GOLDEN_FINGERPRINT
    assert kvtier.KvLayout(32, 8, 128, "bf16", 16, mla=True).fingerprint != GOLDEN_FINGERPRINT
    assert layout == kvtier.KvLayout(32, 8, 128, "bf16", 16)


def test_golden_namespace_encoding() -> None:
    enc = kvtier.NamespaceBuilder(
        "m", 0x1122_3344_5566_7788, tp_rank=1, tp_size=2, adapter_id="lora", cache_salt=b"s"
    ).encode()
    want = b"kvtier/namespace"
    want += bytes([1, 4, 0, 0, 0, 1, 0, 0, 0])
    want += bytes([2, 1, 0, 0, 0, 1])
    want += bytes([3, 1, 0, 0, 0]) + b"m"
    want += bytes([4, 8, 0, 0, 0, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11])
    want += bytes([5, 4, 0, 0, 0, 1, 0, 0, 0])
    want += bytes([6, 4, 0, 0, 0, 2, 0, 0, 0])
    want += bytes([7, 4, 0, 0, 0]) + b"lora"
    want += bytes([8, 1, 0, 0, 0]) + b"s"
    assert enc == want


def test_layout_object_and_fingerprint_give_one_namespace() -> None:
    secret = kvtier.HashSecret.development()
    layout = kvtier.KvLayout(2, 2, 8, "f32", 16)
    a = kvtier.NamespaceBuilder("m", layout).build(secret)
    b = kvtier.NamespaceBuilder("m", layout.fingerprint).build(secret)
    assert a == b and len(a) == kvtier.KEY_BYTES


def test_every_namespace_field_separates_keys() -> None:
    secret = kvtier.HashSecret.development()
    variants = [
        kvtier.NamespaceBuilder("m", 1),
        kvtier.NamespaceBuilder("m2", 1),
        kvtier.NamespaceBuilder("m", 2),
        kvtier.NamespaceBuilder("m", 1, tp_rank=1, tp_size=2),
        kvtier.NamespaceBuilder("m", 1, adapter_id="a"),
        kvtier.NamespaceBuilder("m", 1, cache_salt="tenant-a"),
        kvtier.NamespaceBuilder("m", 1, cache_salt=b"tenant-b"),
    ]
    built = {v.build(secret) for v in variants}
    assert len(built) == len(variants)
    # A str salt is its UTF-8 bytes.
    assert kvtier.NamespaceBuilder("m", 1, cache_salt="t").build(secret) == kvtier.NamespaceBuilder(
        "m", 1, cache_salt=b"t"
    ).build(secret)


def test_partial_trailing_block_has_no_key() -> None:
    h = golden_hasher("xxh3")
    assert len(h.prompt_keys(range(11))) == 2
    assert h.prompt_keys([]) == []
    assert h.block_tokens == 4 and len(h.namespace) == 16


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: kvtier.HashSecret(b"short"), ValueError, "shorter than 16 bytes"),
        (lambda: kvtier.HashSecret(b"x" * 32, "md5"), ValueError, "xxh3, blake3"),
        (lambda: kvtier.KvLayout(0, 8, 128, "bf16", 16), ValueError, "num_layers"),
        (lambda: kvtier.KvLayout(32, 8, 128, "bf16", 12), ValueError, "block_tokens"),
        (lambda: kvtier.KvLayout(32, 8, 128, "int4", 16), ValueError, "dtype"),
        (
            lambda: kvtier.KvLayout(1, 1, 1, "f32", 1).tensor_range(0, "latent"),
            ValueError,
            "latent",
        ),
        (lambda: kvtier.NamespaceBuilder("m", "x"), TypeError, "KvLayout"),
        (
            lambda: kvtier.NamespaceBuilder("m", 1, tp_rank=2, tp_size=2).encode(),
            ValueError,
            "tp_rank",
        ),
        (lambda: golden_hasher("xxh3").block_key(None, [1, 2, 3]), ValueError, "4 tokens, got 3"),
        (lambda: golden_hasher("xxh3").block_key(b"short", [1, 2, 3, 4]), ValueError, "16 bytes"),
        (lambda: golden_hasher("xxh3").prompt_keys([1, -2]), ValueError, "token 1"),
        (lambda: golden_hasher("xxh3").prompt_keys(["a"]), ValueError, "token 0"),
        (
            lambda: kvtier.PrefixHasher(
                kvtier.HashSecret.development(), kvtier.NamespaceBuilder("m", 1), 3
            ),
            ValueError,
            "power of two",
        ),
    ],
)
def test_misuse_raises_with_a_clear_message(make, error, message) -> None:
    with pytest.raises(error, match=message):
        make()
