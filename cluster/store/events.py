"""Block events and the log a consumer reads them from, exactly once or with a gap it can see.

Every tier reports what it holds as events: a block was `stored` or `evicted`.
Consumers (a replica's view of its node's disk, and the fleet index) do not
scan the tiers; they follow the events. So the log must never hand out an
event twice and never skip one silently.

The log numbers events 1, 2, 3, ... and keeps the newest `capacity` of them.
A consumer holds a cursor, the number of the last event it applied, and asks
for what follows:

    since(cursor) -> EventBatch(events with seq > cursor, in order,
                                cursor = seq of the last one returned,
                                gap = True if events after `cursor` were dropped)

When the consumer fell so far behind that events it never saw were already
dropped, `gap` is set and the batch starts at the oldest event still kept: the
consumer must resync from the tier's full contents, read after this batch,
then carry on from the returned cursor. Events that the resync already
reflects may then arrive again; applied in order, stored/evicted events are
idempotent, so the consumer ends in the tier's state. A cursor ahead of the log (the tier restarted, so its
numbering restarted) is a gap too: `epoch` changes on every restart, and a
consumer that sees a new epoch resyncs.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from itertools import islice
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockEvent:
    """A block arrived in (`stored`) or left (`evicted`) one tier."""

    event: str  # "stored" | "evicted"
    tier: str  # "ram" | "disk"
    namespace: bytes
    key: bytes
    parent: bytes  # previous block's id; a checkpoint's own block id
    tokens: int
    nbytes: int
    kind: str = "kv"  # "kv" | "state" (a recurrent checkpoint, stored under state_key(its block id))

    @property
    def block_id(self) -> bytes:
        """The chain block this event is about (for a checkpoint: the block it was taken at the end of)."""
        return self.key if self.kind == "kv" else self.parent


@dataclass(frozen=True)
class EventBatch:
    """One read of an EventLog: apply `events`, then ask again from `cursor`."""

    epoch: str
    cursor: int
    events: list = field(default_factory=list)
    gap: bool = False


class EventLog:
    """A bounded, numbered, thread-safe log of BlockEvents (see the module docstring)."""

    def __init__(self, capacity: int = 100_000):
        self.epoch = os.urandom(8).hex()
        self._events: deque[tuple[int, BlockEvent]] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def last(self) -> int:
        return self._seq

    def append(self, event: BlockEvent) -> int:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, event))
            return self._seq

    def since(self, cursor: int, limit: int = 10_000, epoch: str | None = None) -> EventBatch:
        """Events after `cursor` (at most `limit`); `epoch` is the one the cursor came from."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            foreign = epoch is not None and epoch != self.epoch
            gap = foreign or cursor > self._seq or cursor + 1 < oldest
            start = oldest if gap else cursor + 1
            # Sequence numbers are contiguous, so the first wanted event sits at a known offset.
            skip = start - oldest
            out = [e for _, e in islice(self._events, skip, skip + limit)]
            end = start + len(out) - 1 if out else (self._seq if gap else cursor)
            return EventBatch(epoch=self.epoch, cursor=end, events=out, gap=gap)
