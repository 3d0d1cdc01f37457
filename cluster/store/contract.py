"""The one store contract every tier of blocks answers: the RAM tier and a node's disk (DiskClient).

    present(keys)   -> [bool]              is each key held? (a lookup, not a use)
    get_many(keys)  -> [bytes | None]      the blocks, verified at the tier's level (a disk's: framing,
                                           payload checksum, namespace and key: a reader need not hash
                                           the payload again); a use
    put(key, data)                         keep a block (may be asynchronous for remote tiers)
    discard(key, reason)                   a block was refused as bad: drop it, never serve it again
    stats()         -> dict                counters for status

The question restore asks of any tier - how many blocks of this chain, from
the first, can you give me - is `leading(store.present(ids))`. The fleet index
(fleet_index.py) holds no blocks and is not a store: it answers the same
question for every node at once (`lookup`), from the tiers' events.
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol, runtime_checkable


@runtime_checkable
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
