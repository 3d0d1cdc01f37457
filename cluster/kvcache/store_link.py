"""How a replica reaches its node's disk tier: in process (tests, benchmarks) or through the NodeStore actor.

Both links offer the same synchronous calls. They are made only from the
replica's admission threads and its disk client's background thread - never
from the model thread and never from an event loop - and every actor call is
bounded by a timeout.
"""

from __future__ import annotations

from typing import Optional, Protocol

from cluster.store.block_files import ReadFailure
from cluster.store.disk_tier import DiskStore
from cluster.store.events import EventBatch


class StoreLink(Protocol):
    """The node store's API as a replica sees it."""

    def write(self, ns: bytes, items: list[tuple[bytes, object]]) -> dict: ...
    def present(self, ns: bytes, keys: list[bytes], timeout_s: float) -> list[bool]: ...
    def open_read(self, ns: bytes, keys: list[bytes], timeout_s: float) -> tuple[int, list]: ...
    def close_read(self, lease: int, good: list[bytes], failed: list[ReadFailure]) -> None: ...
    def touch(self, ns: bytes, keys: list[bytes]) -> None: ...
    def quarantine(self, ns: bytes, key: bytes, reason: str, detail: str) -> None: ...
    def events_since(self, cursor: int, epoch: Optional[str]) -> EventBatch: ...
    def keys(self, ns: bytes) -> list[bytes]: ...
    def holdings(self, ns: bytes) -> list[tuple[bytes, str, bytes, int]]: ...


class LocalLink:
    """A DiskStore in this process."""

    def __init__(self, store: DiskStore):
        self.store = store
        self._leases: dict[int, tuple[bytes, list[bytes]]] = {}
        self._next = 0

    def write(self, ns, items):
        return self.store.write_many([(ns, k, d) for k, d in items])

    def present(self, ns, keys, timeout_s=None):
        return self.store.present(ns, keys)

    def open_read(self, ns, keys, timeout_s=None):
        located = self.store.open_read(ns, keys)
        self._next += 1
        self._leases[self._next] = (ns, [k for k, loc in zip(keys, located) if loc])
        return self._next, located

    def close_read(self, lease, good, failed):
        ns, pinned = self._leases.pop(lease)
        self.store.close_read(ns, pinned, good, failed)

    def touch(self, ns, keys):
        self.store.touch(ns, keys)

    def quarantine(self, ns, key, reason, detail):
        if self.store.present(ns, [key])[0]:
            self.store.quarantine(ns, key, reason, detail)

    def events_since(self, cursor, epoch):
        return self.store.events.since(cursor, epoch=epoch)

    def keys(self, ns):
        return self.store.keys(ns)

    def holdings(self, ns):
        return self.store.holdings(ns)


class ActorLink:
    """The node's NodeStore actor."""

    WRITE_TIMEOUT_S = 60.0
    CALL_TIMEOUT_S = 10.0

    def __init__(self, handle):
        self.handle = handle

    def _call(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        import ray

        return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_s)

    def write(self, ns, items):
        return self._call("write", ns, items, timeout_s=self.WRITE_TIMEOUT_S)

    def present(self, ns, keys, timeout_s=CALL_TIMEOUT_S):
        return self._call("present", ns, keys, timeout_s=timeout_s)

    def open_read(self, ns, keys, timeout_s=CALL_TIMEOUT_S):
        return self._call("open_read", ns, keys, timeout_s=timeout_s)

    def close_read(self, lease, good, failed):
        self.handle.close_read.remote(lease, good, failed)  # ordered after open_read; no need to wait

    def touch(self, ns, keys):
        self.handle.touch.remote(ns, keys)

    def quarantine(self, ns, key, reason, detail):
        self.handle.quarantine.remote(ns, key, reason, detail)

    def events_since(self, cursor, epoch):
        return self._call("events_since", cursor, epoch)

    def keys(self, ns):
        return self._call("keys", ns)

    def holdings(self, ns):
        return self._call("holdings", ns)
