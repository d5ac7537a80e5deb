"""kvtier: Python client of the kvtier KV-cache tiering service.

Connect to a kvtier server, look up, get and put KV blocks by key, subscribe to block events,
and make block keys with the same keyed, chained prefix hash as the Rust crates. The work is
done by the compiled module ``kvtier._kvtier`` (kvtier-client and kvtier-core through pyo3);
see docs/python.md in the kvtier repository.
"""

from ._kvtier import (
    HASH_SCHEME_VERSION,
    KEY_BYTES,
    BlockEvent,
    Client,
    EventGap,
    EventStream,
    Fetch,
    HashSecret,
    KvLayout,
    KvPages,
    Lookup,
    NamespaceBuilder,
    PagesLoad,
    PrefixHasher,
    Stored,
)

__all__ = [
    "HASH_SCHEME_VERSION",
    "KEY_BYTES",
    "BlockEvent",
    "Client",
    "EventGap",
    "EventStream",
    "Fetch",
    "HashSecret",
    "KvLayout",
    "KvPages",
    "Lookup",
    "NamespaceBuilder",
    "PagesLoad",
    "PrefixHasher",
    "Stored",
]
