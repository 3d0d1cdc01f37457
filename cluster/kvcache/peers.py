"""Pulling blocks from a peer node's store (migration), through Ray, never through file paths.

The peer's NodeStore reads and verifies the files (a bad one is quarantined
there and comes back as None) and returns the bytes; Ray moves them between
the Macs (the object store for large replies). Requests are cut into chunks of
at most `chunk_bytes`, since a Mac's object store is small by default. The
caller (the admission stage) verifies every block again against the model
before using it. Every transfer is timed: the measured bytes/s per peer link
goes into this replica's index lease, where the gateway's cost model reads it.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from cluster.node import RAY_NAMESPACE, store_actor_name

log = logging.getLogger(__name__)

EMA = 0.3


class PeerClient:
    def __init__(self, namespace: bytes, chunk_bytes: int = 64 << 20, local_stores: Optional[dict] = None):
        """`local_stores`: node id -> DiskStore in this process (tests, benchmarks), instead of Ray actors."""
        self.ns = namespace
        self.chunk_bytes = chunk_bytes
        self.local_stores = local_stores
        self.link_bps: dict[str, float] = {}  # peer node id -> measured bytes/s
        self.counters = {"fetches": 0, "blocks": 0, "bytes": 0, "failures": 0, "seconds": 0.0}

    def fetch(self, peer: str, keys: list[bytes], block_bytes: int, deadline_s: float) -> list[Optional[object]]:
        """The blocks under `keys` from `peer`, in order; stops at the first it cannot get (the rest are None)."""
        out: list[Optional[object]] = []
        end = time.monotonic() + deadline_s
        per_call = max(1, self.chunk_bytes // max(block_bytes, 1))
        try:
            read = self._reader(peer)
            t0, nbytes = time.monotonic(), 0
            for i in range(0, len(keys), per_call):
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"fetch from {peer} passed its {deadline_s:.1f}s deadline")
                got = read(keys[i:i + per_call], remaining)
                for data in got:
                    if data is None:
                        return self._done(peer, out, keys, t0, nbytes)
                    out.append(data)
                    nbytes += len(data)
            return self._done(peer, out, keys, t0, nbytes)
        except Exception as e:  # a dead, slow or missing peer: recompute instead
            log.warning("fetching %d blocks from %s failed: %s", len(keys), peer, e)
            self.counters["failures"] += 1
            return out + [None] * (len(keys) - len(out))

    def stats(self) -> dict:
        """Its counters and each link's measured bytes/s (status: a replica's, and a follower's, `migration`)."""
        return {**self.counters, "link_bytes_per_s": {k: round(v) for k, v in self.link_bps.items()}}

    def _reader(self, peer: str):
        """A function (keys, timeout) -> blocks, reading from the peer's node store."""
        if self.local_stores is not None:
            store = self.local_stores[peer]
            return lambda keys, timeout: store.read_many(self.ns, keys)
        import ray

        actor = ray.get_actor(store_actor_name(peer), namespace=RAY_NAMESPACE)
        return lambda keys, timeout: ray.get(actor.read_blocks.remote(self.ns, keys), timeout=timeout)

    def _done(self, peer: str, out: list, keys: list, t0: float, nbytes: int) -> list:
        seconds = time.monotonic() - t0
        if nbytes and seconds > 0:
            bps = nbytes / seconds
            old = self.link_bps.get(peer)
            self.link_bps[peer] = bps if old is None else (1 - EMA) * old + EMA * bps
        self.counters["fetches"] += 1
        self.counters["blocks"] += len(out)
        self.counters["bytes"] += nbytes
        self.counters["seconds"] = round(self.counters["seconds"] + seconds, 6)
        return out + [None] * (len(keys) - len(out))
