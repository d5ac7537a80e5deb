"""CPU torch tensors as caller buffers (viewed as bytes, no copy). Runs where torch is
installed: scripts/test-vllm.sh runs it in the vLLM environment with KVTIER_REQUIRE_TORCH=1
(then a missing torch fails); python/run-tests.sh's venv has no torch and pytest reports it
skipped, with the reason."""

from __future__ import annotations

import os

import pytest
from conftest import BLOCK, fresh_keys

import kvtier

if os.environ.get("KVTIER_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")


def test_bf16_tensors_round_trip_without_copies(unix_client, tcp_client) -> None:
    for c in (unix_client, tcp_client):
        keys = fresh_keys(2)
        src = torch.randn(2, BLOCK // 2, dtype=torch.bfloat16)
        assert c.put_chain(keys, src).cached == 2
        dst = torch.zeros_like(src)
        assert c.get_into(keys, dst).blocks == 2
        assert torch.equal(dst, src)
        rows = [torch.zeros(BLOCK // 2, dtype=torch.bfloat16) for _ in range(2)]
        assert c.get_into(keys, rows).blocks == 2
        assert torch.equal(torch.stack(rows), src)


def test_pages_in_a_torch_kv_cache(unix_client) -> None:
    # One layer, [K|V][page][token][head][dim] in bf16: K and V of a page are 2 KiB each.
    cache = torch.randn(2, 4, 16, 4, 16, dtype=torch.bfloat16)
    chunk = 16 * 4 * 16 * 2
    pages = kvtier.KvPages([(cache, 0, chunk, chunk), (cache, 4 * chunk, chunk, chunk)])
    keys = fresh_keys(1)
    assert unix_client.put_pages(keys, [2], pages).cached == 1
    other = torch.zeros_like(cache)
    got = unix_client.get_pages(
        keys, [0], kvtier.KvPages([(other, 0, chunk, chunk), (other, 4 * chunk, chunk, chunk)])
    )
    assert got.blocks == 1
    assert torch.equal(other[:, 0], cache[:, 2])


def test_unusable_tensors_are_refused(unix_client) -> None:
    keys = fresh_keys(1)
    strided = torch.zeros(BLOCK, 2, dtype=torch.uint8)[:, 0]
    with pytest.raises(ValueError, match="not contiguous"):
        unix_client.get_into(keys, strided)
    with pytest.raises(ValueError, match="on meta"):
        unix_client.get_into(keys, torch.zeros(BLOCK, dtype=torch.uint8, device="meta"))
