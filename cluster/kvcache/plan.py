"""Where a prompt can resume: the restore position n, from what the tiers hold.

n is at most len(prompt) - 1 (generation needs at least one token to prefill)
and must suit every layer kind:
- full / quantized layers: any n covered by consecutive cached blocks;
- sliding layers: the window [n - W, n) must be inside the stored tails; with
  W >= B that holds for any n, with W < B only at block ends;
- recurrent layers: only where a checkpoint exists, i.e. block ends that were
  checkpointed. So a hybrid falls back to the last checkpoint before the hit.
- on the canonical schedule (engine/schedule.py), only at its cut points.
The largest n satisfying every layer wins.
"""

from __future__ import annotations

import math

from cluster.families.codecs import sliding_keep
from cluster.engine.schedule import Schedule
from cluster.families.specs import Layout, SlidingWindow
from cluster.store.hashing import state_key


class Planner:
    def __init__(self, layout: Layout, block_tokens: int, schedule: Schedule):
        self.layout = layout
        self.B = block_tokens
        self.schedule = schedule
        self.boundary_only = any(isinstance(s, SlidingWindow) and sliding_keep(s, self.B) < self.B
                                 for s in layout.layers)

    def usable_blocks(self, prompt_len: int) -> int:
        """Blocks that can hold restorable tokens (all but the prompt's last token)."""
        return math.ceil((prompt_len - 1) / self.B) if prompt_len > 1 else 0

    def candidates(self, prompt_len: int, hit: int) -> list[int]:
        """Restore positions worth trying with `hit` leading blocks held, largest first."""
        limit = min(hit * self.B, prompt_len - 1)
        if limit <= 0:
            return []
        out = sorted({limit, *(j * self.B for j in range(1, hit + 1) if j * self.B <= limit)}, reverse=True)
        return [n for n in out if self.schedule.resumable(n)]

    def checkpoint_ends(self, prompt_len: int, hit: int) -> list[int]:
        """Block counts j whose end-of-block checkpoint could serve as the restore point."""
        if not self.layout.has_recurrent:
            return []
        return [c // self.B for c in self.candidates(prompt_len, hit) if c % self.B == 0]

    def best(self, prompt_len: int, hit: int, checkpoints: set[int]) -> int:
        """The largest restorable n (0: restore nothing)."""
        return next((c for c in self.candidates(prompt_len, hit) if self.restorable(c, checkpoints)), 0)

    def restorable(self, n: int, checkpoints: set[int]) -> bool:
        at_boundary = n % self.B == 0
        if self.boundary_only and not at_boundary:
            return False
        if self.layout.has_recurrent:
            return at_boundary and n // self.B in checkpoints
        return True

    def reads(self, ids: list[bytes], n: int) -> list[tuple[str, int, bytes]]:
        """What restoring n tokens reads, as (kind, block index, key): its KV blocks, then
        (hybrids) the checkpoint taken at the end of block n/B - 1."""
        out = [("kv", j, ids[j]) for j in range(math.ceil(n / self.B))]
        if self.layout.has_recurrent and n:
            j = n // self.B - 1
            out.append(("state", j, state_key(ids[j])))
        return out

    def keys(self, ids: list[bytes], n: int) -> list[bytes]:
        return [key for _, _, key in self.reads(ids, n)]
