"""kvtier's KV connector for vLLM (``KVConnectorBase_V1``).

Enable it with vLLM's own KV-transfer configuration::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"url": "unix:///run/kvtier/kvtier.sock"}}'

What it does (docs/vllm.md has the whole story, the settings and the byte map):

* **Scheduler side.** Each prompt's full blocks are hashed with kvtier's keyed, chained hasher
  over vLLM's block size, in a namespace made of the model, the KV layout, the
  tensor-parallel rank and the request's ``cache_salt``. One lookup finds the longest prefix
  kvtier holds; the part past vLLM's own prefix-cache hit is reported to vLLM when loading it
  is cheaper than computing it (a cost model fed by what the workers measure).
* **Worker side.** Before the forward, the blocks to load are fetched into a staging buffer
  (one ``get`` per request; zero-copy out of the server's arena over the Unix socket) and
  copied into vLLM's paged KV tensors by block id. After the forward, newly computed prompt
  blocks are copied out of the paged tensors into a staging buffer and handed to a saver
  thread that stores them as a chain; a bounded queue drops (and counts) saves under
  back-pressure, so the forward never waits on kvtier.
* **Failures.** A block that does not arrive (server absent, slow, restarted, corrupt copy)
  is reported through ``get_block_ids_with_load_errors``; with
  ``kv_load_failure_policy="recompute"`` vLLM recomputes those tokens. After a failure the
  connector leaves kvtier alone for ``backoff_s`` seconds, so a dead or stuck server costs at
  most one timeout per ``backoff_s``.
* **Retention hints.** A request whose ``kv_transfer_params`` carry ``kvtier_retain_s`` (the
  client expects to send the conversation again after that many seconds: an agent waiting
  on a tool) asks the server, once the request is finished and its blocks are stored, to
  keep the prompt's blocks in DRAM until then (kvtier's ``retain``).

This module imports vLLM and torch; ``import kvtier`` does not import it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

import kvtier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.vllm")

__all__ = [
    "MAX_RETAIN_S",
    "KvtierConnector",
    "KvtierConnectorStats",
    "KvtierSettings",
    "RetainHint",
    "gather_blocks",
    "kvtier_block_view",
    "layout_from_spec",
    "scatter_blocks",
]

# The longest `kvtier_retain_s` a request may give: a day (the protocol's limit on a hint).
MAX_RETAIN_S = 86_400.0

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# "remote": a block the server's cluster fetched from another member for the lookup (it is
# in the server's DRAM by then).
_TIERS = ("hbm", "dram", "nvme", "remote")


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass
class KvtierSettings:
    """The connector's settings, from ``kv_connector_extra_config`` (keys as below)."""

    url: str
    token: str | None = None
    quic_cert: str | None = None
    # Seconds one kvtier call may take before it counts as failed (lookup: the scheduler's;
    # get and put: the worker's).
    lookup_timeout_s: float = 0.5
    io_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    # After a failed or timed-out call, leave kvtier alone this long.
    backoff_s: float = 5.0
    # Over unix:// with the arena, answer a lookup the server's published slot table settles
    # from it, with no round trip (sent to the server one way). Off: every lookup asks.
    local_lookups: bool = True
    load: bool = True
    # Load layer by layer on a thread of the connector's while the forward runs (each attention
    # layer waits for its own layer only); host pages (vLLM-cpu) only. Off: whole requests
    # before the forward.
    load_layerwise: bool = False
    # "prompt": store the prompt's full blocks once computed; "off": never store.
    save: str = "prompt"
    load_tiers: tuple[str, ...] = _TIERS
    # Bytes of copied-out blocks waiting for the saver thread; past this, saves are dropped.
    max_pending_save_bytes: int = 512 << 20
    # The cost model's starting guesses, replaced by what the workers measure.
    load_bytes_per_s: float = 2e9
    prefill_tokens_per_s: float | None = None
    # A fixed cost of a load (one round trip and the copies' set-up), seconds.
    load_overhead_s: float = 0.002
    model_id: str | None = None
    hash_secret: bytes | None = None
    hash_scheme: str = "xxh3"
    stats_file: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvtierSettings:
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__} | {"hash_secret_file", "token_file"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kvtier connector: unknown kv_connector_extra_config keys {unknown}; "
                f"known: {sorted(known)}"
            )
        url = extra.pop("url", None) or os.environ.get("KVTIER_URL")
        if not url:
            raise ValueError(
                "kvtier connector: kv_connector_extra_config needs 'url' "
                "(unix:///path/kvtier.sock, tcp://host:port, tls://host:port or quic://host:port), "
                "or set KVTIER_URL"
            )
        token_file = extra.pop("token_file", None)
        if token_file:
            with open(token_file, encoding="utf-8") as f:
                extra["token"] = f.read().strip()
        secret_file = extra.pop("hash_secret_file", None)
        if secret_file:
            with open(secret_file, "rb") as f:
                extra["hash_secret"] = f.read().strip()
        if isinstance(extra.get("hash_secret"), str):
            extra["hash_secret"] = extra["hash_secret"].encode()
        if "load_tiers" in extra:
            tiers = tuple(extra["load_tiers"])
            bad = [t for t in tiers if t not in _TIERS]
            if bad or not tiers:
                raise ValueError(
                    f"kvtier connector: load_tiers {list(tiers)}: each must be one of {_TIERS}"
                )
            extra["load_tiers"] = tiers
        s = cls(url=url, **extra)
        if s.save not in ("prompt", "off"):
            raise ValueError(f"kvtier connector: save={s.save!r}: 'prompt' or 'off'")
        for name in ("lookup_timeout_s", "io_timeout_s", "connect_timeout_s", "load_bytes_per_s"):
            if not float(getattr(s, name)) > 0:
                raise ValueError(f"kvtier connector: {name} must be > 0")
        if s.backoff_s < 0 or s.max_pending_save_bytes < 0:
            raise ValueError("kvtier connector: backoff_s and max_pending_save_bytes >= 0")
        if s.prefill_tokens_per_s is not None and not s.prefill_tokens_per_s > 0:
            raise ValueError("kvtier connector: prefill_tokens_per_s must be > 0")
        return s


@dataclass(frozen=True)
class RetainHint:
    """A request's retention hint, from its ``kv_transfer_params`` (``RetainHint.of``)."""

    return_s: float
    session: int = 0
    priority: int = 0

    @classmethod
    def of(cls, params: Any) -> RetainHint | None:
        """The hint in a request's ``kv_transfer_params``, ``None`` when it gives none;
        ``ValueError`` naming the field when a value is not what it may be:

        * ``kvtier_retain_s``: seconds until the client expects to send the conversation
          again, a number from 0 to ``MAX_RETAIN_S``;
        * ``kvtier_session``: the conversation's id (an integer from 0 to 2**64 - 1, or a
          string, hashed to one): a newer hint of the same session replaces the older;
          0 (the default) is no session;
        * ``kvtier_retain_priority``: 0 (the default) to 7; over the server's budget a hint
          displaces hints of lower priority, and of its own priority those that end later.
        """
        if params is None:
            return None
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        secs = params.get("kvtier_retain_s")
        if secs is None:
            return None
        if isinstance(secs, bool) or not isinstance(secs, (int, float)):
            raise ValueError(f"kvtier_retain_s must be a number of seconds, got {secs!r}")
        if not 0 <= secs <= MAX_RETAIN_S:  # also refuses NaN
            raise ValueError(
                f"kvtier_retain_s must be between 0 and {MAX_RETAIN_S:.0f}, got {secs}"
            )
        session = params.get("kvtier_session", 0)
        if isinstance(session, str):
            digest = hashlib.blake2b(session.encode(), digest_size=8).digest()
            session = int.from_bytes(digest, "little") or 1
        elif isinstance(session, bool) or not isinstance(session, int) or not 0 <= session < 2**64:
            raise ValueError(
                "kvtier_session must be a string or an integer from 0 to 2**64 - 1, "
                f"got {session!r}"
            )
        prio = params.get("kvtier_retain_priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int) or not 0 <= prio <= 7:
            raise ValueError(f"kvtier_retain_priority must be an integer from 0 to 7, got {prio!r}")
        return cls(float(secs), session, prio)


# --------------------------------------------------------------------------------------------
# Layout: vLLM's paged tensors <-> kvtier blocks
# --------------------------------------------------------------------------------------------


def layout_from_spec(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> kvtier.KvLayout:
    """kvtier's block layout for one vLLM block: layer-major ``[layer][K|V][token][head][dim]``."""
    if dtype not in _DTYPES:
        raise ValueError(
            f"kvtier connector: KV cache dtype {dtype} is not supported "
            f"(supported: {sorted(str(d) for d in _DTYPES)})"
        )
    return kvtier.KvLayout(num_layers, num_kv_heads, head_dim, _DTYPES[dtype], block_size)


def kvtier_block_view(
    t: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """A view of one layer's paged KV tensor as ``[num_blocks, 2, block_size, heads, dim]``
    (K then V, token-major: kvtier's order inside a layer), without copying.

    Known layouts:

    * vLLM-cpu: ``[num_blocks, heads, block_size, 2 * dim]`` as allocated (or
      ``[num_blocks, heads, 2 * block_size, dim]``), each (block, head) slab all the block's K
      rows, then its V rows;
    * CUDA backends (FlashAttention, Triton): ``[2, num_blocks, block_size, heads, dim]``;
    * FlashInfer NHD: ``[num_blocks, 2, block_size, heads, dim]``;
    * HND: ``[num_blocks, 2, heads, block_size, dim]``.
    """
    s = tuple(t.shape)
    h, d, b = num_kv_heads, head_dim, block_size
    if len(s) == 4 and s[1:] in ((h, 2 * b, d), (h, b, 2 * d)) and t.is_contiguous():
        # vLLM-cpu allocates [blocks, heads, block, 2 * dim] but its attention kernel reads each
        # (block, head) slab as [2 * block, dim]: all K rows, then all V rows
        # (v1/attention/backends/cpu_attn.py).
        return t.view(s[0], h, 2, b, d).permute(0, 2, 3, 1, 4)
    if len(s) == 5 and s[0] == 2 and s[2:] == (b, h, d):
        return t.permute(1, 0, 2, 3, 4)
    if len(s) == 5 and s[1:] == (2, b, h, d):
        return t
    if len(s) == 5 and s[1:] == (2, h, b, d):
        return t.permute(0, 1, 3, 2, 4)
    raise ValueError(
        f"kvtier connector: unsupported paged KV tensor shape {list(s)} "
        f"(block_size {b}, kv heads {h}, head dim {d}); supported: vLLM-cpu "
        "[blocks, heads, 2*block, dim] and CUDA [2, blocks, block, heads, dim]"
    )


def kvtier_pages(tensors: list[torch.Tensor], views: list[torch.Tensor]) -> kvtier.KvPages:
    """Every layer's paged KV tensor (host memory) as ``kvtier.KvPages``: the regions of one
    vLLM block in kvtier's byte order (layer, K|V, token, head; one ``dim`` row each, merged
    where the layout makes them adjacent), so blocks move between kvtier and vLLM's pages by
    block id in one copy, in Rust, with the GIL released. ``views[i]`` is
    ``kvtier_block_view(tensors[i], ...)``."""
    regions: list[tuple[Any, int, int, int]] = []
    for t, v in zip(tensors, views, strict=True):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("kvtier connector: pages need contiguous host tensors")
        es = t.element_size()
        s_blk, s_kv, s_tok, s_head, s_dim = v.stride()
        _, _, b, h, d = v.shape
        if s_dim != 1:
            raise ValueError(f"kvtier connector: head dim not contiguous (strides {v.stride()})")
        buf = t.detach().reshape(-1).view(torch.uint8).numpy()
        base = (v.data_ptr() - t.data_ptr()) // es
        for kv in range(2):
            for tok in range(b):
                for head in range(h):
                    off = (base + kv * s_kv + tok * s_tok + head * s_head) * es
                    regions.append((buf, off, s_blk * es, d * es))
    return kvtier.KvPages(regions)


def scatter_blocks(views: list[torch.Tensor], block_ids: list[int], staging: torch.Tensor) -> None:
    """Copies ``staging[i]`` (host memory, ``[n, layers, 2, block, heads, dim]``: kvtier
    blocks) into block ``block_ids[i]`` of every layer's view (``kvtier_block_view``), on the
    views' device (host to device first when that is a GPU)."""
    if not block_ids:
        return
    dev = views[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
    src = staging[: len(block_ids)]
    if dev.type != "cpu":
        src = src.to(dev, non_blocking=True)
    for layer, view in enumerate(views):
        view[ids] = src[:, layer]


def load_staged(
    client: kvtier.Client,
    keys: list[bytes],
    views: list[torch.Tensor],
    block_ids: list[int],
    staging: torch.Tensor,
) -> kvtier.Fetch:
    """A load through a host staging tensor (``[n, layers, 2, block, heads, dim]``, pinned
    for a GPU): the longest cached prefix of ``keys`` into ``staging``, then its blocks into
    blocks ``block_ids`` of the views (``scatter_blocks``). The path for device tensors (vLLM's
    GPU build), where ``kvtier_pages`` cannot address the pages."""
    fetch = client.get_into(keys, staging.view(torch.uint8).numpy())
    scatter_blocks(views, block_ids[: fetch.blocks], staging)
    return fetch


def gather_blocks(views: list[torch.Tensor], block_ids: list[int], staging: torch.Tensor) -> None:
    """The inverse of ``scatter_blocks``: block ``block_ids[i]`` of every layer into
    ``staging[i]`` (host memory)."""
    if not block_ids:
        return
    dev = views[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
    for layer, view in enumerate(views):
        staging[: len(block_ids), layer].copy_(view[ids])


# --------------------------------------------------------------------------------------------
# Metadata (scheduler -> workers, once per step)
# --------------------------------------------------------------------------------------------


@dataclass
class BlockRun:
    """Blocks ``first .. first + len(block_ids)`` of a request's prompt."""

    req_id: str
    # The prompt's tokens up to the end of the run (the workers hash them with their own
    # tensor-parallel rank's namespace).
    tokens: list[int]
    cache_salt: str | None
    first: int
    block_ids: list[int]


@dataclass
class RetainRun:
    """A finished request's retention hint: its prompt's first ``len(tokens) // block``
    blocks (those stored or found in kvtier)."""

    tokens: list[int]
    cache_salt: str | None
    hint: RetainHint


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    # Hints of requests finished since the last step, sent after this step's saves.
    retains: list[RetainRun] = field(default_factory=list)
    step_tokens: int = 0


# --------------------------------------------------------------------------------------------
# Stats (workers -> scheduler and vLLM's stats logger)
# --------------------------------------------------------------------------------------------

# Each counter, and what it counts: vLLM's Prometheus endpoint serves each as
# ``vllm:kvtier_<name>_total`` (KvtierPromMetrics), its stats log as ``<name>=``.
_COUNTER_DOCS = {
    "lookups": "Lookups the scheduler sent to kvtier.",
    "lookup_failures": "Lookups that failed (server absent, slow or erroring): recomputed.",
    "lookup_timeouts": "Of the failed lookups, those that timed out.",
    "lookup_hit_tokens": "Tokens the lookups found in kvtier past vLLM's own prefix cache.",
    "loads_declined": "Hits not loaded because the cost model judged recomputing cheaper.",
    "load_requests": "Requests whose blocks the workers loaded from kvtier.",
    "loaded_blocks": "Blocks loaded from kvtier into vLLM's KV cache.",
    "loaded_bytes": "Bytes loaded from kvtier into vLLM's KV cache.",
    "layerwise_loaded_blocks": "Of the loaded blocks, those copied layer by layer.",
    "load_seconds": "Seconds the workers spent loading from kvtier.",
    "load_error_blocks": "Blocks planned for loading that did not arrive: recomputed by vLLM.",
    "load_timeouts": "Loads whose get timed out (their missing blocks are load errors).",
    "load_corrupt": "Loads cut short by a block the server found corrupt (and dropped).",
    "saved_blocks": "Blocks stored in kvtier (or found there already).",
    "saved_bytes": "Bytes stored in kvtier.",
    "save_dropped_blocks": "Blocks not saved because the save queue was full (back-pressure).",
    "save_failed_blocks": "Blocks whose save failed or was refused by the server.",
    "compute_tokens": "Prompt tokens computed in the steps the cost model measured.",
    "compute_seconds": "Seconds of those steps (the cost model's prefill rate).",
    "retain_hints_invalid": "Retention hints refused as malformed (the request still ran).",
    "retain_hints_accepted": "Retention hints the server accepted.",
    "retain_hints_refused": "Retention hints the server refused (its budgets, nothing cached).",
    "retain_hints_failed": "Retention hints that could not be sent.",
}
_COUNTERS = tuple(_COUNTER_DOCS)


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counters of one interval; vLLM logs ``reduce()`` ("KV Transfer metrics: ...")."""

    def __post_init__(self) -> None:
        for k in _COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        for k, v in (other.data or {}).items():
            if k in _COUNTERS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in _COUNTERS}
        secs = out["load_seconds"]
        out["load_gb_per_s"] = round(out["loaded_bytes"] / secs / 1e9, 3) if secs else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _COUNTERS)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's own Prometheus endpoint (``/metrics`` of ``vllm
    serve``): ``vllm:kvtier_<name>_total``, labelled like vLLM's series (model, engine), fed
    with each interval's counters as vLLM's stat logger receives them."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}
        for name, doc in _COUNTER_DOCS.items():
            counter = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames
            )
            self._series[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, by_engine in self._series.items():
            v = transfer_stats_data.get(name, 0)
            if isinstance(v, (int, float)) and v > 0 and engine_idx in by_engine:
                by_engine[engine_idx].inc(v)


class _Counters:
    """Interval counters (shipped to vLLM each step) and running totals (the stats file)."""

    def __init__(self, stats_file: str | None, role: str) -> None:
        self.interval = {k: 0 for k in _COUNTERS}
        self.total = {k: 0 for k in _COUNTERS}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._path = f"{stats_file}.{role}.json" if stats_file else None
        self._dirty = False

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.interval[k] += v
                self.total[k] += v
            self._dirty = True

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.interval = self.interval, {k: 0 for k in _COUNTERS}
            return out

    def flush(self) -> None:
        """Writes the totals to the stats file, if one is configured and they changed."""
        if self._path is None:
            return
        # The saver thread and the step both flush. The snapshot is taken under the write
        # lock, so files are written in the order of their snapshots: an older snapshot
        # written after a newer one would leave the file behind the totals, and nothing
        # would correct it until the next change (a CI run read 17 loaded blocks short).
        with self._write_lock:
            with self._lock:
                if not self._dirty:
                    return
                self._dirty = False
                data = dict(self.total)
            tmp = f"{self._path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(data, f)
                os.replace(tmp, self._path)
            except OSError as e:
                logger.warning(
                    "kvtier connector: cannot write the stats file %s: %s", self._path, e
                )


# --------------------------------------------------------------------------------------------
# The connection, with a breaker
# --------------------------------------------------------------------------------------------


class _Link:
    """A kvtier client made on first use and remade after a failure, with a breaker: after a
    failed or timed-out call nothing is sent for ``backoff_s`` seconds."""

    def __init__(self, s: KvtierSettings, timeout: float, block_bytes: int, name: str) -> None:
        self._s = s
        self._timeout = timeout
        self._block_bytes = block_bytes
        self._name = name
        self._client: kvtier.Client | None = None
        self._open_until = 0.0
        self._last_log = 0.0
        self._lock = threading.Lock()

    def get(self) -> kvtier.Client | None:
        with self._lock:
            if time.monotonic() < self._open_until:
                return None
            if self._client is None:
                try:
                    self._client = self._connect()
                except ValueError as e:
                    # A block size the server does not use (it was restarted with another
                    # layout): a configuration error, logged as the reason.
                    self._trip(f"{self._s.url} does not serve this model's blocks: {e}")
                except Exception as e:  # noqa: BLE001 - any failure to connect means "no cache"
                    self._trip(f"cannot connect to {self._s.url}: {e}")
            return self._client

    def check(self) -> None:
        """Connects now: a server that does not serve this model's block size is an error
        (raised); one that does not answer is logged and tried again later."""
        with self._lock:
            try:
                self._client = self._connect()
            except ValueError as e:
                raise ValueError(
                    f"kvtier connector: the kvtier server at {self._s.url} does not serve "
                    f"this model's KV blocks ({self._block_bytes} bytes): {e}"
                ) from e
            except Exception as e:  # noqa: BLE001
                self._trip(f"cannot connect to {self._s.url}: {e}")

    def _connect(self) -> kvtier.Client:
        return kvtier.Client(
            self._s.url,
            token=self._s.token,
            quic_cert=self._s.quic_cert,
            timeout=self._timeout,
            connect_timeout=self._s.connect_timeout_s,
            local_lookups=self._s.local_lookups,
            reconnect_backoff=self._s.backoff_s,
            block_bytes=self._block_bytes,
            name=self._name,
        )

    def failed(self, what: str) -> None:
        with self._lock:
            self._trip(what)

    def _trip(self, what: str) -> None:
        now = time.monotonic()
        self._open_until = now + self._s.backoff_s
        if now - self._last_log > 30.0:
            self._last_log = now
            logger.warning(
                "kvtier connector: %s; computing without kvtier for %.1f s",
                what,
                self._s.backoff_s,
            )


# A miss that means the cache is not answering (as opposed to "not cached").
_FAILED = frozenset({"timeout", "disconnected", "unavailable", "io_error"})


# --------------------------------------------------------------------------------------------
# The connector
# --------------------------------------------------------------------------------------------


# How long a request's lookup answers vLLM's repeated questions while it waits to be scheduled.
_LOOKUP_REUSE_S = 1.0


@dataclass
class _Req:
    """What the scheduler side knows of a request."""

    tokens: list[int]
    cache_salt: str | None
    full_blocks: int  # full blocks of the prompt (the ones that can be stored)
    loadable: int  # full blocks of the prompt minus its last token (the ones that can be loaded)
    in_kvtier: int = 0  # blocks kvtier held at the last lookup
    looked_up_at: float | None = None  # time.monotonic() of that lookup
    matched: tuple[int, int] | None = None  # blocks reported to vLLM (first, end)
    planned: tuple[int, int] | None = None  # blocks to load (first, end), once allocated
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0


class KvtierConnector(KVConnectorBase_V1):
    """kvtier as vLLM's external KV cache (module ``kvtier.vllm``, class ``KvtierConnector``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._s = KvtierSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            logger.warning(
                "kvtier connector: kv_load_failure_policy is %r: a block kvtier fails to "
                "deliver will fail its request; set it to 'recompute'",
                policy,
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ValueError(
                f"kvtier connector: the model has {len(groups)} KV cache groups (a hybrid or "
                "sliding-window model); the connector supports one group of full attention"
            )
        if groups and type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec":
            raise ValueError(
                "kvtier connector: KV cache spec "
                f"{type(groups[0].kv_cache_spec).__name__} is not supported (full attention only)"
            )
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        self._block_size = int(cc.block_size)
        dtype = mc.dtype if cc.cache_dtype in (None, "auto") else None
        if dtype is None:
            raise ValueError(
                f"kvtier connector: kv_cache_dtype {cc.cache_dtype!r} is not supported "
                "(use 'auto': the model's dtype)"
            )
        self._layout = layout_from_spec(
            mc.get_num_layers(pc),
            mc.get_num_kv_heads(pc),
            mc.get_head_size(),
            dtype,
            self._block_size,
        )
        self._torch_dtype = dtype
        # The scheduler looks up rank 0's keys; each worker stores and loads its own rank's.
        self._tp_rank = 0
        if role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed import get_tensor_model_parallel_rank

                self._tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
                self._tp_rank = 0
        self._tp_size = pc.tensor_parallel_size
        self._model_id = self._s.model_id or mc.model
        secret = (
            kvtier.HashSecret(self._s.hash_secret, self._s.hash_scheme)
            if self._s.hash_secret
            else kvtier.HashSecret.development()
        )
        self._secret = secret
        self._hashers: dict[str | None, kvtier.PrefixHasher] = {}
        is_sched = role == KVConnectorRole.SCHEDULER
        self._counters = _Counters(self._s.stats_file, "scheduler" if is_sched else "worker")
        timeout = self._s.lookup_timeout_s if is_sched else self._s.io_timeout_s
        self._link = _Link(
            self._s,
            timeout,
            self._layout.block_bytes,
            f"vllm-{'scheduler' if is_sched else 'worker'}-{self._tp_rank}",
        )
        self._link.check()
        # Scheduler side.
        self._reqs: dict[str, _Req] = {}
        self._retains: list[RetainRun] = []
        self._load_bps = float(self._s.load_bytes_per_s)
        self._prefill_tps = self._s.prefill_tokens_per_s
        # Worker side.
        self._views: list[torch.Tensor] = []
        # Host memory (vLLM-cpu): the pages, for one-copy loads and saves in Rust. On a GPU the
        # copies go through a staging tensor (scatter_blocks / gather_blocks).
        self._pages: kvtier.KvPages | None = None
        self._device: torch.device | None = None
        self._load_errors: set[int] = set()
        # Layer-wise loads: the attention layers' names -> layer index, and this step's loads.
        self._layer_of: dict[str, int] = {}
        self._layer_loads: _LayerLoads | None = None
        self._step_start = 0.0
        self._step_load_s = 0.0
        self._saver: _Saver | None = None
        logger.info(
            "kvtier connector (%s): %s, layout %d layers x %d kv heads x %d x %s, "
            "%d tokens per block (%d bytes), model %r, tp rank %d/%d",
            "scheduler" if is_sched else "worker",
            self._s.url,
            self._layout.num_layers,
            self._layout.num_kv_heads,
            self._layout.head_dim,
            self._layout.dtype,
            self._block_size,
            self._layout.block_bytes,
            self._model_id,
            self._tp_rank,
            self._tp_size,
        )

    # ---------------------------------------------------------------- keys

    def _hasher(self, salt: str | None) -> kvtier.PrefixHasher:
        h = self._hashers.get(salt)
        if h is None:
            ns = kvtier.NamespaceBuilder(
                self._model_id,
                self._layout,
                tp_rank=self._tp_rank,
                tp_size=self._tp_size,
                cache_salt=salt,
            )
            h = kvtier.PrefixHasher(self._secret, ns, self._block_size)
            self._hashers[salt] = h
        return h

    def block_keys(self, tokens: Iterable[int], salt: str | None) -> list[bytes]:
        """The kvtier keys of the full blocks of ``tokens`` under this rank's namespace."""
        return self._hasher(salt).prompt_keys(tokens)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            bs = self._block_size
            st = _Req(
                tokens=tokens,
                cache_salt=getattr(request, "cache_salt", None),
                full_blocks=len(tokens) // bs,
                loadable=max(len(tokens) - 1, 0) // bs,
            )
            self._reqs[request.request_id] = st
        st.planned = st.matched = None
        first = num_computed_tokens // self._block_size
        if not self._s.load or st.loadable <= first:
            return 0, False
        now = time.monotonic()
        if st.looked_up_at is not None and now - st.looked_up_at < _LOOKUP_REUSE_S:
            # vLLM asks again each step a waiting request is not scheduled: answer from the
            # last lookup (a block evicted since is a load error, recomputed).
            n = st.in_kvtier
        else:
            client = self._link.get()
            if client is None:
                self._counters.add(lookup_failures=1)
                return 0, False
            keys = self.block_keys(st.tokens[: st.loadable * self._block_size], st.cache_salt)
            found = client.lookup(keys)
            self._counters.add(lookups=1)
            if found.miss in _FAILED:
                self._link.failed(f"lookup: {found.miss} ({found.miss_detail})")
                self._counters.add(lookup_failures=1, lookup_timeouts=found.miss == "timeout")
                return 0, False
            n = 0
            for tier in found.tiers:
                if tier not in self._s.load_tiers:
                    break
                n += 1
            st.in_kvtier = n
            st.looked_up_at = now
        if n <= first:
            return 0, False
        tokens = (n - first) * self._block_size
        if not self._worth_loading(n - first, tokens):
            self._counters.add(loads_declined=1)
            return 0, False
        self._counters.add(lookup_hit_tokens=tokens)
        st.matched = (first, n)
        return tokens, False

    def _worth_loading(self, blocks: int, tokens: int) -> bool:
        """Loading beats computing: the cost model (as the reference worker's)."""
        if self._prefill_tps is None:
            return True
        load_s = self._s.load_overhead_s + blocks * self._layout.block_bytes / self._load_bps
        return load_s < tokens / self._prefill_tps

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.matched is None:
            return
        first, end = st.matched
        st.planned = (first, min(end, first + num_external_tokens // self._block_size))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvtierMetadata(step_tokens=scheduler_output.total_num_scheduled_tokens)
        meta.retains, self._retains = self._retains, []
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, st, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, st, cached.num_computed_tokens[i] + sched.get(req_id, 0))
        return meta

    def _plan(self, meta: KvtierMetadata, req_id: str, st: _Req, computed: int) -> None:
        bs = self._block_size
        if st.planned is not None:
            a, b = st.planned
            st.planned = None
            if b <= len(st.block_ids):
                meta.loads.append(
                    BlockRun(req_id, st.tokens[: b * bs], st.cache_salt, a, st.block_ids[a:b])
                )
        if self._s.save != "prompt":
            return
        start = max(st.saved_upto, st.in_kvtier)
        end = min(computed // bs, st.full_blocks, len(st.block_ids))
        if end > start:
            meta.saves.append(
                BlockRun(
                    req_id, st.tokens[: end * bs], st.cache_salt, start, st.block_ids[start:end]
                )
            )
            st.saved_upto = end

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        try:
            hint = RetainHint.of(getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            # The request is served all the same: a bad hint is the client's error, logged
            # and counted, never a failed request.
            logger.warning("kvtier connector: request %s: %s", request.request_id, e)
            self._counters.add(retain_hints_invalid=1)
            hint = None
        status = getattr(getattr(request, "status", None), "name", "")
        if hint is not None and st is not None and status != "FINISHED_ABORTED":
            blocks = max(st.saved_upto, st.in_kvtier)
            if blocks > 0:
                # Sent by the workers after the next step's saves: the same saver queue that
                # stores the prompt's blocks, so the hint finds them stored.
                tokens = st.tokens[: blocks * self._block_size]
                self._retains.append(RetainRun(tokens, st.cache_salt, hint))
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Feeds the cost model with what the workers measured."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) or {}
        if data.get("load_seconds", 0) > 0 and data.get("loaded_bytes", 0) > 0:
            bps = data["loaded_bytes"] / data["load_seconds"]
            self._load_bps = 0.7 * self._load_bps + 0.3 * bps
        if data.get("compute_seconds", 0) > 0 and data.get("compute_tokens", 0) > 0:
            tps = data["compute_tokens"] / data["compute_seconds"]
            self._prefill_tps = (
                tps if self._prefill_tps is None else 0.7 * self._prefill_tps + 0.3 * tps
            )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._counters.take()
        self._counters.flush()
        stats = KvtierConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        lay = self._layout
        # Layer order: the tensors, their views and the layer index of each attention layer.
        names = sorted(kv_caches, key=_layer_index)
        tensors = [kv_caches[name] for name in names]
        views = [
            kvtier_block_view(t, self._block_size, lay.num_kv_heads, lay.head_dim) for t in tensors
        ]
        if len(views) != lay.num_layers:
            raise ValueError(
                f"kvtier connector: vLLM registered {len(views)} KV tensors, the model has "
                f"{lay.num_layers} layers"
            )
        for name, t in kv_caches.items():
            if t.dtype != self._torch_dtype:
                raise ValueError(f"kvtier connector: {name} is {t.dtype}, not {self._torch_dtype}")
        self._views = views
        self._layer_of = {name: i for i, name in enumerate(names)}
        self._device = tensors[0].device
        if self._device.type == "cpu":
            self._pages = kvtier_pages(tensors, views)
        self._saver = _Saver(self._link, self._counters, self._s.max_pending_save_bytes)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_start = time.perf_counter()
        self._step_load_s = 0.0

    def _staging(self, n: int) -> torch.Tensor:
        lay = self._layout
        shape = (n, lay.num_layers, 2, self._block_size, lay.num_kv_heads, lay.head_dim)
        pin = self._device is not None and self._device.type == "cuda"
        return torch.empty(shape, dtype=self._torch_dtype, pin_memory=pin)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._finish_layer_loads()  # a step whose wait_for_save did not run (none expected)
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierMetadata) or not meta.loads or not self._views:
            return
        t0 = time.perf_counter()
        if self._s.load_layerwise and self._pages is not None:
            self._start_layer_loads(meta.loads)
        else:
            for run in meta.loads:
                self._load_run(run)
        self._step_load_s += time.perf_counter() - t0

    def _count_load_miss(self, fetch: kvtier.Fetch) -> None:
        """Why a load stopped short, counted by kind; a failed call opens the breaker."""
        if fetch.miss in _FAILED:
            self._link.failed(f"get: {fetch.miss} ({fetch.miss_detail})")
        self._counters.add(
            load_timeouts=fetch.miss == "timeout", load_corrupt=fetch.miss == "corrupt"
        )

    def _start_layer_loads(self, runs: list[BlockRun]) -> None:
        """Fetches (pins) every run's blocks now, and copies them into the pages layer by
        layer on a thread while the forward runs (``wait_for_layer_load``)."""
        assert self._pages is not None
        loads: list[tuple[kvtier.PagesLoad, list[int]]] = []
        client = self._link.get()
        for run in runs:
            n, keys = len(run.block_ids), self._run_keys(run)
            got = 0
            if client is not None and len(keys) == n:
                ld = client.load_pages(keys, run.block_ids, self._pages)
                got = ld.fetch.blocks
                self._count_load_miss(ld.fetch)
                if got:
                    loads.append((ld, run.block_ids[:got]))
                else:
                    ld.release()
            self._load_errors.update(run.block_ids[got:])
            self._counters.add(load_requests=1, load_error_blocks=n - got)
        if loads:
            lay = self._layout
            self._layer_loads = _LayerLoads(
                loads, self._pages, lay.num_layers, lay.block_bytes // lay.num_layers
            )

    def _finish_layer_loads(self) -> None:
        """Waits for this step's layer-wise loads (their copies are done by the end of the
        forward), releases their pins, and counts what arrived and what did not."""
        loads, self._layer_loads = self._layer_loads, None
        if loads is None:
            return
        failed = loads.finish()
        self._load_errors.update(failed)
        ok = loads.blocks - len(failed)
        self._counters.add(
            loaded_blocks=ok,
            layerwise_loaded_blocks=ok,
            loaded_bytes=ok * self._layout.block_bytes,
            load_seconds=loads.seconds,
            load_error_blocks=len(failed),
        )

    def _run_keys(self, run: BlockRun) -> list[bytes]:
        """The keys of a run's blocks (its prompt's chain, from block ``run.first``)."""
        return self.block_keys(run.tokens, run.cache_salt)[
            run.first : run.first + len(run.block_ids)
        ]

    def _load_run(self, run: BlockRun) -> None:
        n, keys = len(run.block_ids), self._run_keys(run)
        client = self._link.get()
        got = 0
        t0 = time.perf_counter()
        if client is not None and len(keys) == n:
            if self._pages is not None:
                # One copy: from the server's arena (unix) straight into vLLM's pages.
                fetch = client.get_pages(keys, run.block_ids, self._pages)
            else:
                fetch = load_staged(client, keys, self._views, run.block_ids, self._staging(n))
            got = fetch.blocks
            self._count_load_miss(fetch)
        failed = run.block_ids[got:]
        self._load_errors.update(failed)
        self._counters.add(
            load_requests=1,
            loaded_blocks=got,
            loaded_bytes=got * self._layout.block_bytes,
            load_seconds=time.perf_counter() - t0,
            load_error_blocks=len(failed),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Whole-request loads are finished in start_load_kv, before the forward; layer-wise
        # ones are waited for here, one layer at a time.
        loads = self._layer_loads
        if loads is not None:
            loads.wait(
                self._layer_of.get(layer_name, len(self._layer_of) - 1), self._s.io_timeout_s
            )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saves copy whole blocks out of the registered tensors in wait_for_save.
        return

    def wait_for_save(self) -> None:
        # The forward is over: no layer reads a loaded page any more.
        self._finish_layer_loads()
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierMetadata) or not self._views:
            return
        if meta.step_tokens >= 2 * self._block_size:
            spent = time.perf_counter() - self._step_start - self._step_load_s
            self._counters.add(compute_tokens=meta.step_tokens, compute_seconds=max(spent, 0.0))
        if self._saver is None:
            return
        for run in meta.saves:
            n = len(run.block_ids)
            nbytes = n * self._layout.block_bytes
            if not self._saver.admit(nbytes):
                self._counters.add(save_dropped_blocks=n)
                continue
            keys = self.block_keys(run.tokens, run.cache_salt)
            staging = self._staging(n)
            if self._pages is not None:
                self._pages.gather(run.block_ids, staging.view(torch.uint8).numpy())
            else:
                gather_blocks(self._views, run.block_ids, staging)
            parent = keys[run.first - 1] if run.first > 0 else None
            self._saver.submit(keys[run.first : run.first + n], parent, staging, nbytes)
        for r in meta.retains:
            self._saver.retain(self.block_keys(r.tokens, r.cache_salt), r.hint)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close(timeout=self._s.io_timeout_s + 1.0)
        self._counters.flush()


def _layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer's name ("model.layers.12.self_attn.attn")."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise ValueError(f"kvtier connector: no layer number in the KV tensor name {name!r}")


class _LayerLoads:
    """One step's layer-wise loads: a thread copies every fetched block's layer 0 into vLLM's
    pages, then layer 1, and so on, while the forward runs; ``wait(layer)`` (the attention
    layer's ``wait_for_layer_load``) returns once that layer is in. A load whose pins' lease
    runs out, or a layer that does not arrive within the timeout, makes its blocks load
    errors (recomputed by vLLM); the thread stops copying for a cancelled step."""

    def __init__(
        self,
        loads: list[tuple[kvtier.PagesLoad, list[int]]],
        pages: kvtier.KvPages,
        num_layers: int,
        layer_bytes: int,
    ) -> None:
        self._loads = loads
        self.blocks = sum(len(ids) for _, ids in loads)
        self.seconds = 0.0
        self._done = [threading.Event() for _ in range(num_layers)]
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._failed: set[int] = set()
        self._thread = threading.Thread(
            target=self._run,
            args=(pages, num_layers, layer_bytes),
            name="kvtier-layer-load",
            daemon=True,
        )
        self._thread.start()

    def _fail(self, ids: Iterable[int]) -> None:
        with self._lock:
            self._failed.update(ids)

    def _run(self, pages: kvtier.KvPages, num_layers: int, layer_bytes: int) -> None:
        t0 = time.perf_counter()
        live = list(self._loads)
        try:
            for layer in range(num_layers):
                lo, hi = layer * layer_bytes, (layer + 1) * layer_bytes
                keep = []
                for ld, ids in live:
                    if self._cancel.is_set():
                        return
                    if ld.copy_range(pages, lo, hi):
                        keep.append((ld, ids))
                    else:  # released, or its lease about to run out: not loaded
                        self._fail(ids)
                live = keep
                self._done[layer].set()
        except Exception as e:  # noqa: BLE001 - a failed copy is a failed load, not a crash
            logger.warning("kvtier connector: layer-wise load failed: %s", e)
            for _, ids in live:
                self._fail(ids)
        finally:
            self.seconds = time.perf_counter() - t0
            for d in self._done:
                d.set()

    def _abandon(self) -> None:
        """Stops the copying; every block of the step counts as not loaded."""
        self._cancel.set()
        for _, ids in self._loads:
            self._fail(ids)

    def wait(self, layer: int, timeout: float) -> None:
        if not self._done[layer].wait(timeout):
            self._abandon()

    def finish(self) -> set[int]:
        """Joins the thread (it has copied everything by the end of the forward, or stops at
        its next copy once cancelled), releases the pins; the blocks that did not arrive."""
        if not self._done[-1].is_set():
            # The forward ended before the last layer was in (a layer vLLM did not wait for):
            # what it read of these blocks may not be them.
            self._abandon()
        # Not bounded by a timeout: once cancelled the thread stops at its next copy, and a
        # copy is a bounded memory copy (no I/O), so nothing it loads can land in a page after
        # this step.
        self._thread.join()
        for ld, _ in self._loads:
            ld.release()
        with self._lock:
            return set(self._failed)


class _Saver:
    """One thread storing copied-out blocks as chains, and sending retention hints after the
    stores queued before them; the queue of blocks is bounded in bytes."""

    def __init__(self, link: _Link, counters: _Counters, max_bytes: int) -> None:
        self._link = link
        self._counters = counters
        self._max = max_bytes
        self._pending = 0
        self._lock = threading.Lock()
        # (job, bytes of blocks it holds): the calls the thread makes, in order.
        self._q: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvtier-saver", daemon=True)
        self._thread.start()

    def admit(self, nbytes: int) -> bool:
        with self._lock:
            if self._pending + nbytes > self._max:
                return False
            self._pending += nbytes
            return True

    def submit(self, keys: list[bytes], parent: bytes | None, buf: torch.Tensor, n: int) -> None:
        """Stores ``keys`` from ``buf`` (``n`` bytes, admitted by ``admit``)."""
        self._q.put((lambda: self._store(keys, parent, buf), n))

    def retain(self, keys: list[bytes], hint: RetainHint) -> None:
        """Sends a retention hint for ``keys`` once the stores queued before it are done."""
        self._q.put((lambda: self._retain(keys, hint), 0))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, nbytes = item
            try:
                job()
            finally:
                with self._lock:
                    self._pending -= nbytes
                self._counters.flush()

    def _store(self, keys: list[bytes], parent: bytes | None, buf: torch.Tensor) -> None:
        client = self._link.get()
        if client is None:
            self._counters.add(save_failed_blocks=len(keys))
            return
        stored = client.put_chain(keys, buf.view(torch.uint8).numpy(), parent=parent)
        if stored.failure is not None:
            if stored.failure in _FAILED:
                self._link.failed(f"put: {stored.failure} ({stored.failure_detail})")
            self._counters.add(save_failed_blocks=len(keys))
            return
        ok = sum(s in ("stored", "already_present") for s in stored.statuses)
        self._counters.add(
            saved_blocks=ok,
            saved_bytes=ok * buf[0].numel() * buf.element_size(),
            save_failed_blocks=len(keys) - ok,
        )

    def _retain(self, keys: list[bytes], hint: RetainHint) -> None:
        client = self._link.get()
        if client is None:
            self._counters.add(retain_hints_failed=1)
            return
        try:
            r = client.retain(keys, hint.return_s, session=hint.session, priority=hint.priority)
        except Exception as e:  # noqa: BLE001 - a failed call: the breaker, as for a put
            self._link.failed(f"retain: {e}")
            self._counters.add(retain_hints_failed=1)
            return
        if r["status"] == "accepted":
            self._counters.add(retain_hints_accepted=1)
        else:
            # Refused by the server (its budgets, nothing cached, too far, hints off).
            self._counters.add(retain_hints_refused=1)

    def close(self, timeout: float) -> None:
        self._q.put(None)
        self._thread.join(timeout)
