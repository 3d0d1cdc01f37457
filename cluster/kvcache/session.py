"""BlockSession: the engine's CacheSession backed by a PrefixCache.

It restores the prefix the admission stage fetched, cuts prefill chunks where the
schedule says (engine/schedule.py; on the block schedule also where a recurrent
checkpoint is due), and after every forward stores each newly completed block
the schedule keeps (prompt or generated), before a sliding window can rotate
its tokens out, and seals them (one evaluation of their device copies). Once the
prompt is prefilled, it keeps the prompt's tail too (tails.py). During
decode it keeps (by reference, no copy) the recurrent state at the latest block
end, and stores it when the request ends, so the next turn of a chat can resume
right after this reply.

On a sharded replica every rank has a BlockSession of its own over its own cache, and `shard` makes them
restore the same tokens or none (shard_restore.py); a follower's has no prefetch of its own.
"""

from __future__ import annotations

import logging
from typing import Optional

from cluster.families.codecs import CaptureError
from cluster.kvcache.prefix_cache import Prefetch, PrefixCache
from cluster.kvcache.shard_restore import ShardRestore
from cluster.store.hashing import chain_ids

log = logging.getLogger(__name__)


class BlockSession:
    uses_cache = True  # a sharded replica's followers restore too (engine/lockstep.py describes it)

    def __init__(self, cache: PrefixCache, prompt: list[int], prefetch: Optional[Prefetch],
                 shard: Optional[ShardRestore] = None):
        self.pc = cache
        self.shard = shard
        self.B = cache.B
        self.prompt = prompt
        self.prefetch = prefetch
        self.fetched: tuple[int, Optional[str]] = (0, None)  # tokens restored from a peer's blocks, and the peer
        self.ids: list[bytes] = []
        self.done_blocks = 0  # blocks [0, done_blocks) are stored or known stored
        self.pending_state: Optional[tuple[int, list]] = None
        self.fed: list[int] = []

    def restore(self) -> tuple[list, int]:
        if self.shard is not None:
            self.prefetch = self.shard.settle(self.prompt, self.prefetch)
        agreed = self.prefetch.n
        caches, n, self.ids = self.pc.restore(self.prompt, self.prefetch)
        if self.shard is not None and not self.shard.confirm(n == agreed) and n:
            caches, n = self.pc.new_caches(), 0  # another rank could not build it: every rank prefills cold
        if n == self.prefetch.n and self.prefetch.fetched:
            self.fetched = (self.prefetch.fetched, self.prefetch.fetched_from)
        self.prefetch = None  # its blocks are in the caches now; let the bytes go
        self.done_blocks = n // self.B
        return caches, n

    def next_stop(self, start: int, limit: int, step: int) -> int:
        """The schedule's cut (engine/schedule.py). On the block schedule a hybrid's chunk also ends at
        every block end where a checkpoint is due; on the canonical one checkpoints are due at cuts only."""
        schedule = self.pc.schedule
        end = schedule.next_stop(start, limit, step)
        if self.pc.layout.has_recurrent and not schedule.canonical:
            for j in range(start // self.B + 1, end // self.B + 1):
                if self.pc.checkpoint_due(j - 1, len(self.prompt)):
                    return j * self.B
        return end

    def observe(self, caches: list, fed: list[int]) -> None:
        self.fed = fed
        try:
            self._store_blocks(caches)
            if self.pc.layout.has_recurrent and fed and len(fed) % self.B == 0 and len(fed) <= self.kept:
                self._checkpoint(caches, len(fed) // self.B - 1)
            if len(fed) == len(self.prompt) - 1:  # prefilled: the prompt's tail, for the very same prompt
                self.pc.store_tail(self.prompt, self.ids, caches)
        except CaptureError as e:  # never fail a request because a block could not be kept
            self.pc.counters.capture_errors += 1
            log.warning("could not capture a block: %s", e)
        self.pc.seal()

    @property
    def kept(self) -> int:
        """Tokens whose blocks (and checkpoints) may serve a later hit (PrefixCache.kept_tokens): on the
        canonical schedule, those of the prompt's complete chunks only."""
        return self.pc.kept_tokens(len(self.prompt))

    def close(self, caches: list, fed: list[int], completed: bool) -> None:
        """Keep the recurrent state at the last block end of prompt + reply, for the next turn."""
        if self.pending_state is not None:
            index, state = self.pending_state
            self.pending_state = None
            if index == len(fed) // self.B - 1:
                self._store_state(index, state)
                self.pc.seal()

    # -----------------------------------------------------------------------
    def _store_blocks(self, caches: list) -> None:
        full = min(len(self.fed), self.kept) // self.B
        if len(self.ids) < full:
            parent = self.ids[-1] if self.ids else None
            self.ids += chain_ids(self.pc.namespace, self.fed[: full * self.B], self.B, parent,
                                  start_block=len(self.ids))
        if self.done_blocks < full:
            self.pc.store_blocks(self.done_blocks, [(self.ids[j], self._parent(j), self._tokens(j))
                                                    for j in range(self.done_blocks, full)], caches)
            self.done_blocks = full

    def _checkpoint(self, caches: list, index: int) -> None:
        state = self.pc.snapshot_state(caches)
        if self.pc.checkpoint_due(index, len(self.prompt)):
            self._store_state(index, state)
            self.pending_state = None
        else:
            self.pending_state = (index, state)

    def _store_state(self, index: int, state: list) -> None:
        self.pc.store_state(index, self.ids[index], self._parent(index), self._tokens(index), state)

    def _parent(self, index: int) -> bytes:
        return self.ids[index - 1] if index else self.pc.namespace

    def _tokens(self, index: int) -> list[int]:
        return self.fed[index * self.B:(index + 1) * self.B]
