"""The one store contract every tier answers: the RAM tier, a node's disk, and the fleet index.

    present(keys)   -> [bool]              is each key held? (a lookup, not a use)
    get_many(keys)  -> [bytes | None]      the blocks, verified at the tier's level; a use
    put(key, data)                         keep a block (may be asynchronous for remote tiers)
    discard(key, reason)                   a block was refused as bad: drop it, never serve it again
    stats()         -> dict                counters for status

The question routing and restore ask of any tier - how many blocks of this
chain, from the first, can you give me - is `leading(store.present(ids))`.
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol


class BlockStore(Protocol):
    def present(self, keys: list[bytes]) -> list[bool]: ...

    def get_many(self, keys: list[bytes]) -> list[Optional[bytes]]: ...

    def put(self, key: bytes, data) -> object: ...

    def discard(self, key: bytes, reason: str) -> object: ...

    def stats(self) -> dict: ...


def leading(flags: Iterable[bool]) -> int:
    """How many flags, from the first, are all true: the consecutive prefix a tier holds."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n
