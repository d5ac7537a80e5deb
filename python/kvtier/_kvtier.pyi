# Type stubs of the compiled module (python/src/*.rs).

import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal, final

from typing_extensions import Buffer, Self, TypeAlias

# A caller buffer: anything with the buffer protocol (bytes, bytearray, memoryview, numpy
# arrays), or a CPU torch tensor (viewed as bytes, no copy).
_BufferLike: TypeAlias = Buffer | Any
_Key: TypeAlias = bytes | bytearray | memoryview
_MissKind: TypeAlias = Literal[
    "not_cached",
    "corrupt",
    "io_error",
    "busy",
    "timeout",
    "disconnected",
    "unavailable",
    "refused",
]
_TierName: TypeAlias = Literal["hbm", "dram", "nvme"]
# A lookup's tiers add "remote": fetched from another cluster member (see `Lookup.sources`).
_LookupTierName: TypeAlias = Literal["hbm", "dram", "nvme", "remote"]
_PutStatusName: TypeAlias = Literal[
    "stored",
    "already_present",
    "rejected_backlog",
    "rejected_no_slot",
    "rejected_orphan",
    "failed",
]

__all__ = [
    "BlockEvent",
    "Client",
    "EventGap",
    "EventStream",
    "Fetch",
    "HASH_SCHEME_VERSION",
    "HashSecret",
    "KEY_BYTES",
    "KvLayout",
    "KvPages",
    "Lookup",
    "NamespaceBuilder",
    "PagesLoad",
    "PrefixHasher",
    "Stored",
]

HASH_SCHEME_VERSION: int
KEY_BYTES: int

@final
class HashSecret:
    def __new__(cls, secret: bytes, scheme: Literal["xxh3", "blake3"] = "xxh3") -> Self: ...
    @staticmethod
    def development() -> HashSecret: ...
    @property
    def scheme(self) -> str: ...

@final
class KvLayout:
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Literal["f32", "f16", "bf16", "fp8e4m3", "fp8e5m2"],
        block_tokens: int,
        mla: bool = False,
    ) -> Self: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def mla(self) -> bool: ...
    @property
    def tensors_per_layer(self) -> int: ...
    @property
    def token_bytes(self) -> int: ...
    @property
    def tensor_bytes(self) -> int: ...
    @property
    def layer_bytes(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def fingerprint(self) -> int: ...
    def layer_range(self, layer: int) -> tuple[int, int]: ...
    def tensor_range(
        self, layer: int, tensor_name: Literal["k", "key", "v", "value", "latent"]
    ) -> tuple[int, int]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

@final
class NamespaceBuilder:
    def __new__(
        cls,
        model_id: str,
        layout: KvLayout | int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        adapter_id: str | None = None,
        cache_salt: str | bytes | None = None,
    ) -> Self: ...
    def encode(self, scheme: Literal["xxh3", "blake3"] = "xxh3") -> bytes: ...
    def build(self, secret: HashSecret) -> bytes: ...

@final
class PrefixHasher:
    def __new__(
        cls, secret: HashSecret, namespace: NamespaceBuilder, block_tokens: int
    ) -> Self: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def namespace(self) -> bytes: ...
    def prompt_keys(self, tokens: Iterable[int]) -> list[bytes]: ...
    def block_key(self, parent: _Key | None, tokens: Iterable[int]) -> bytes: ...

@final
class KvPages:
    def __new__(cls, regions: Iterable[tuple[_BufferLike, int, int, int]]) -> Self: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def num_regions(self) -> int: ...
    def gather(self, page_ids: Sequence[int], out: _BufferLike) -> None: ...
    def scatter(self, src: _BufferLike, page_ids: Sequence[int]) -> None: ...

@final
class Lookup:
    @property
    def blocks(self) -> int: ...
    @property
    def tiers(self) -> list[_LookupTierName]: ...
    @property
    def sources(self) -> list[tuple[int, int, str]]: ...
    @property
    def miss(self) -> _MissKind | None: ...
    @property
    def miss_detail(self) -> str | None: ...

@final
class Fetch:
    @property
    def blocks(self) -> int: ...
    @property
    def tiers(self) -> list[_TierName]: ...
    @property
    def miss(self) -> _MissKind | None: ...
    @property
    def miss_detail(self) -> str | None: ...

@final
class PagesLoad:
    @property
    def fetch(self) -> Fetch: ...
    def copy_range(self, pages: KvPages, lo: int, hi: int) -> bool: ...
    def release(self) -> None: ...

@final
class Stored:
    @property
    def statuses(self) -> list[_PutStatusName]: ...
    @property
    def failure(self) -> _MissKind | None: ...
    @property
    def failure_detail(self) -> str | None: ...
    @property
    def cached(self) -> int: ...

@final
class BlockEvent:
    @property
    def seq(self) -> int: ...
    @property
    def kind(self) -> Literal["stored", "removed", "cleared", "unknown"]: ...
    @property
    def tier(self) -> _TierName | None: ...
    @property
    def key(self) -> bytes: ...

@final
class EventGap:
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...

@final
class EventStream:
    @property
    def start_seq(self) -> int: ...
    def __iter__(self) -> Self: ...
    def __next__(self) -> BlockEvent | EventGap: ...
    def next(self, timeout: float | None = None) -> BlockEvent | EventGap | None: ...

@final
class Client:
    def __new__(
        cls,
        url: str,
        *,
        token: str | None = None,
        server_cert: bytes | str | os.PathLike[str] | None = None,
        server_name: str | None = None,
        quic_cert: bytes | str | os.PathLike[str] | None = None,
        quic_server_name: str | None = None,
        client_cert: bytes | str | os.PathLike[str] | None = None,
        client_key: bytes | str | os.PathLike[str] | None = None,
        timeout: float = 5.0,
        connect_timeout: float = 2.0,
        reconnect_backoff: float = 1.0,
        block_bytes: int = 0,
        zero_copy: bool = True,
        lease: float = 10.0,
        name: str = "kvtier-python",
        local_lookups: bool = True,
    ) -> Self: ...
    @property
    def url(self) -> str: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def is_local(self) -> bool: ...
    def ping(self) -> float: ...
    def lookup(self, keys: Iterable[_Key]) -> Lookup: ...
    def get_into(
        self, keys: Iterable[_Key], bufs: _BufferLike | Sequence[_BufferLike]
    ) -> Fetch: ...
    def put_chain(
        self,
        keys: Iterable[_Key],
        bufs: _BufferLike | Sequence[_BufferLike],
        parent: _Key | None = None,
    ) -> Stored: ...
    def put(
        self,
        keys: Iterable[_Key],
        parents: Iterable[_Key | None],
        bufs: _BufferLike | Sequence[_BufferLike],
    ) -> Stored: ...
    def get_pages(self, keys: Iterable[_Key], page_ids: Sequence[int], pages: KvPages) -> Fetch: ...
    def load_pages(
        self, keys: Iterable[_Key], page_ids: Sequence[int], pages: KvPages
    ) -> PagesLoad: ...
    def put_pages(
        self,
        keys: Iterable[_Key],
        page_ids: Sequence[int],
        pages: KvPages,
        parent: _Key | None = None,
    ) -> Stored: ...
    def prefetch(self, keys: Iterable[_Key]) -> int: ...
    def retain(
        self,
        keys: Iterable[_Key],
        expected_return_s: float,
        session: int = 0,
        priority: int = 0,
    ) -> dict[str, Any]: ...
    def remove(self, keys: Iterable[_Key]) -> int: ...
    def clear(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def events(self, from_seq: int | None = None, snapshot: bool = False) -> EventStream: ...
