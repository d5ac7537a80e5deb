"""Blocks copied between kvtier and an engine's paged KV tensors by page id (`KvPages`), as
a vLLM worker does: one tensor per layer, `[K|V][page][token][head][dim]`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import BLOCK, fresh_keys, start_server

import kvtier

LAYERS, PAGES, TOKENS, HEADS, DIM = 2, 8, 16, 2, 16  # 2 x 2 x 1 KiB = one 4 KiB block
CHUNK = TOKENS * HEADS * DIM * 2  # one layer's K (or V) of one page, f16


def engine(seed: int | None) -> list[np.ndarray]:
    shape = (2, PAGES, TOKENS, HEADS, DIM)
    if seed is None:
        return [np.zeros(shape, np.float16) for _ in range(LAYERS)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(LAYERS)]


def pages_of(layers: list[np.ndarray]) -> kvtier.KvPages:
    # Block bytes in kvtier's order: layer 0 K, layer 0 V, layer 1 K, layer 1 V.
    regions = []
    for t in layers:
        regions.append((t, 0, CHUNK, CHUNK))  # K of page p at p * CHUNK
        regions.append((t, PAGES * CHUNK, CHUNK, CHUNK))  # V after all K pages
    return kvtier.KvPages(regions)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_pages_round_trip_between_two_engines(transport, unix_client, tcp_client) -> None:
    c = unix_client if transport == "unix" else tcp_client
    a = engine(seed=21)
    pa = pages_of(a)
    assert (pa.block_bytes, pa.num_pages, pa.num_regions) == (BLOCK, PAGES, 4)
    keys = fresh_keys(3)
    stored = c.put_pages(keys, [1, 3, 6], pa)
    assert stored.cached == 3, stored

    # The block bytes are layer-major: layer 0 K, layer 0 V, layer 1 K, layer 1 V.
    flat = np.zeros((3, BLOCK), np.uint8)
    assert c.get_into(keys, flat).blocks == 3
    want0 = b"".join(a[layer][kv, 1].tobytes() for layer in range(LAYERS) for kv in range(2))
    assert flat[0].tobytes() == want0

    # Another engine loads them into other pages; the rest of its cache is untouched.
    b = engine(seed=None)
    got = c.get_pages(keys, [5, 0, 2], pages_of(b))
    assert (got.blocks, got.miss) == (3, None)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(b[layer][:, 5], a[layer][:, 1])
        np.testing.assert_array_equal(b[layer][:, 0], a[layer][:, 3])
        np.testing.assert_array_equal(b[layer][:, 2], a[layer][:, 6])
        for untouched in (1, 3, 4, 6, 7):
            assert not b[layer][:, untouched].any()


def test_a_partial_hit_fills_the_leading_pages_only(unix_client) -> None:
    a = engine(seed=5)
    keys = fresh_keys(3)
    assert unix_client.put_pages(keys[:1], [0], pages_of(a)).cached == 1
    b = engine(seed=None)
    got = unix_client.get_pages(keys, [4, 5, 6], pages_of(b))
    assert (got.blocks, got.miss, got.tiers) == (1, "not_cached", ["dram"])
    np.testing.assert_array_equal(b[0][:, 4], a[0][:, 0])
    assert not b[0][:, 5:].any()


def test_a_prefix_over_the_pin_budget_is_loaded_in_rounds(tmp_path: Path) -> None:
    """A server that pins part of a prefix and answers "busy" for the rest (here: requests
    of at most 2 keys; in use, a prefix DRAM cannot hold pinned at once): a 5-block prefix
    still arrives whole, round by round, into the right pages; so does a partial hit, which
    ends with the miss that stopped it."""
    srv = start_server(tmp_path, ["limits.max_keys=2"])
    try:
        c = kvtier.Client(srv.unix_url, timeout=5.0)
        a = engine(seed=33)
        keys = fresh_keys(6)
        assert c.put_pages(keys[:5], [0, 1, 2, 3, 4], pages_of(a)).cached == 5
        # One pin holds 2 of them (a layer-wise load pins once: it gets those two).
        once = c.load_pages(keys[:5], [0, 1, 2, 3, 4], pages_of(engine(seed=None)))
        assert (once.fetch.blocks, once.fetch.miss) == (2, "busy")
        once.release()
        b = engine(seed=None)
        got = c.get_pages(keys[:5], [7, 6, 5, 4, 3], pages_of(b))
        assert (got.blocks, got.miss, got.tiers) == (5, None, ["dram"] * 5)
        for layer in range(LAYERS):
            for i, page in enumerate([7, 6, 5, 4, 3]):
                np.testing.assert_array_equal(b[layer][:, page], a[layer][:, i])
        got = c.get_pages(keys, [0, 1, 2, 3, 4, 5], pages_of(engine(seed=None)))
        assert (got.blocks, got.miss) == (5, "not_cached")
    finally:
        assert srv.stop() == 0


def test_pages_misuse_raises(unix_client) -> None:
    t = engine(seed=None)
    p = pages_of(t)
    keys = fresh_keys(2)
    with pytest.raises(ValueError, match="page id 8"):
        unix_client.get_pages(keys, [0, 8], p)
    with pytest.raises(ValueError, match="overlapping"):
        unix_client.get_pages(keys, [3, 3], p)
    with pytest.raises(ValueError, match="2 keys but 1 page ids"):
        unix_client.get_pages(keys, [3], p)
    half = kvtier.KvPages([(t[0], 0, CHUNK, CHUNK)])
    with pytest.raises(ValueError, match="add up to 1024 bytes"):
        unix_client.put_pages(keys, [0, 1], half)
    with pytest.raises(ValueError, match="at most the stride"):
        kvtier.KvPages([(t[0], 0, 10, CHUNK)])
    with pytest.raises(ValueError, match="past the buffer"):
        kvtier.KvPages([(t[0], t[0].nbytes - 10, CHUNK, CHUNK)])
    with pytest.raises(ValueError, match="read-only"):
        kvtier.KvPages([(bytes(BLOCK), 0, BLOCK, BLOCK)])
    with pytest.raises(ValueError, match="region 0: expected"):
        kvtier.KvPages([(t[0], -1, CHUNK, CHUNK)])


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_load_fills_the_pages_range_by_range(transport, unix_client, tcp_client) -> None:
    """`load_pages` fetches (pins, over the Unix socket) and writes nothing; each
    `copy_range` writes that byte range of every fetched block (a layer, or any cut that
    splits a region), so the ranges together give what `get_pages` gives. After `release`
    nothing more is copied."""
    c = unix_client if transport == "unix" else tcp_client
    a = engine(seed=33)
    keys = fresh_keys(3)
    assert c.put_pages(keys[:2], [2, 7], pages_of(a)).cached == 2
    b = engine(seed=None)
    pb = pages_of(b)
    load = c.load_pages(keys, [1, 4, 6], pb)
    assert (load.fetch.blocks, load.fetch.miss) == (2, "not_cached")
    assert not any(x.any() for x in b), "nothing is written before copy_range"
    layer_bytes = BLOCK // LAYERS
    # Layer 1 first, then layer 0 in two cuts, one inside a region (its K).
    assert load.copy_range(pb, layer_bytes, BLOCK)
    assert not b[0].any() and b[1][:, 1].any()
    assert load.copy_range(pb, 0, CHUNK // 2) and load.copy_range(pb, CHUNK // 2, layer_bytes)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(b[layer][:, 1], a[layer][:, 2])
        np.testing.assert_array_equal(b[layer][:, 4], a[layer][:, 7])
        assert not b[layer][:, 6].any(), "the missed block's page stays untouched"
    load.release()
    b[0][:] = 0
    assert not load.copy_range(pb, 0, BLOCK), "released: nothing copied"
    assert not b[0].any()
    with pytest.raises(ValueError, match="not inside a block"):
        load.copy_range(pb, 0, BLOCK + 1)
