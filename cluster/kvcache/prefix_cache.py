"""PrefixCache: a replica's view of its block cache for one model.

It answers three questions for the engine:
- plan:    how many leading prompt tokens can be restored exactly?
- restore: build mlx-lm caches holding exactly those tokens;
- store:   encode a finished block (or a recurrent checkpoint) into the tier.

Choosing the restore position n (at most len(prompt) - 1: generation needs at
least one token to prefill):
- full / quantized layers: any n covered by consecutive cached blocks;
- sliding layers: the window [n - W, n) must be inside the stored tails; with
  W >= B that holds for any n, with W < B only at block ends;
- recurrent layers: only where a checkpoint exists, i.e. block ends that were
  checkpointed. So a hybrid falls back to the last checkpoint before the hit.
The largest n satisfying every layer wins. A block that fails to decode is a
miss: it is dropped, counted, and the plan shrinks to the blocks before it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from cluster.config import CacheConfig
from cluster.families.codecs import capture_block, capture_state, new_cache, restore_entry, sliding_keep
from cluster.families.specs import Layout, Recurrent, SlidingWindow
from cluster.store import block_format
from cluster.store.arrays import dtype_tag, host_views, to_mlx
from cluster.store.block_format import Block, BlockError, Expect
from cluster.store.hashing import chain_ids, state_key
from cluster.kvcache.tiers import TieredBlocks

log = logging.getLogger(__name__)

# Every BlockError reason, fixed up front so the counters never change shape while read.
CORRUPT_REASONS = sorted({cls.reason for cls in (BlockError, *BlockError.__subclasses__())})


@dataclass
class Plan:
    """What a prompt can reuse: its block ids and where to restore to."""

    ids: list[bytes]
    n: int


@dataclass
class CacheCounters:
    lookups: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    blocks_stored: int = 0
    checkpoints_stored: int = 0
    capture_errors: int = 0
    corrupt: dict = field(default_factory=lambda: {r: 0 for r in CORRUPT_REASONS})

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "hit_requests": self.hit_requests, "hit_tokens": self.hit_tokens,
                "blocks_stored": self.blocks_stored, "checkpoints_stored": self.checkpoints_stored,
                "capture_errors": self.capture_errors, "corrupt": dict(self.corrupt)}


class PrefixCache:
    def __init__(self, layout: Layout, namespace: bytes, config: CacheConfig, tier: TieredBlocks, dtype: mx.Dtype,
                 state_bytes: int = 0, kv_bytes_per_token: int = 0):
        self.layout = layout
        self.namespace = namespace
        self.B = config.block_tokens
        self.tier = tier
        self.dtype = dtype_tag(dtype)
        self.codec = [config.kv_codec, 1, config.kv_group_size]
        self.described = layout.describe()
        self.every = checkpoint_interval(state_bytes, kv_bytes_per_token * self.B, config.checkpoint_overhead)
        self.counters = CacheCounters()

    # -- cold caches ---------------------------------------------------------
    def new_caches(self) -> list:
        return [new_cache(spec) for spec in self.layout.layers]

    # -- planning ------------------------------------------------------------
    def plan(self, prompt: list[int], max_blocks: int | None = None) -> Plan:
        ids = chain_ids(self.namespace, prompt, self.B)
        hit = self.tier.prefix_hits(ids if max_blocks is None else ids[:max_blocks])
        limit = min(hit * self.B, len(prompt) - 1)
        candidates = sorted({limit, *(j * self.B for j in range(1, hit + 1) if j * self.B <= limit)}, reverse=True)
        checkpoints: set[int] = set()
        if self.layout.has_recurrent and hit:  # one lookup for every candidate's checkpoint
            ends = [c // self.B for c in candidates if c and c % self.B == 0]
            checkpoints = {j for j, f in zip(ends, self.tier.present([state_key(ids[j - 1]) for j in ends])) if f}
        n = next((c for c in candidates if c > 0 and self._restorable(c, checkpoints)), 0)
        return Plan(ids=ids, n=n)

    def _restorable(self, n: int, checkpoints: set[int]) -> bool:
        at_boundary = n % self.B == 0
        for spec in self.layout.layers:
            if isinstance(spec, SlidingWindow) and sliding_keep(spec, self.B) < self.B and not at_boundary:
                return False
        if self.layout.has_recurrent:
            return at_boundary and n // self.B in checkpoints
        return True

    def checkpoint_due(self, block_index: int, prompt_len: int) -> bool:
        """Every `every`-th block end, the prompt's last full block end (where the next turn
        resumes), and the last block end before the prompt's final token (where the very
        same prompt resumes: generation needs one token left to prefill)."""
        return ((block_index + 1) % self.every == 0 or block_index == prompt_len // self.B - 1
                or block_index == (prompt_len - 1) // self.B - 1)

    # -- restore -------------------------------------------------------------
    def restore(self, prompt: list[int]) -> tuple[list, int, list[bytes]]:
        """Caches holding the longest restorable prefix of `prompt`, its length, and the prompt's block ids."""
        self.counters.lookups += 1
        plan = self.plan(prompt)
        while plan.n:
            try:
                caches = self._build(plan, len(prompt))
                self.counters.hit_requests += 1
                self.counters.hit_tokens += plan.n
                return caches, plan.n, plan.ids
            except BlockError as e:
                bad = getattr(e, "block_index", 0)
                log.warning("block %d of a cached prefix is unusable (%s): %s; treating it as a miss",
                            bad, e.reason, e)
                self.counters.corrupt[e.reason] += 1
                plan = self.plan(prompt, max_blocks=bad)
        return self.new_caches(), 0, plan.ids

    def _build(self, plan: Plan, prompt_len: int) -> list:
        n, m = plan.n, math.ceil(plan.n / self.B)
        keys = plan.ids[:m]
        if self.layout.has_recurrent:
            keys = keys + [state_key(plan.ids[n // self.B - 1])]
        datas = self.tier.get_many(keys)  # RAM, then one batched disk read
        parts: list[list] = [[None] * m for _ in self.layout.layers]
        for j in range(m):
            block = self._decode(datas[j], plan.ids[j], "kv", plan.ids[j - 1] if j else self.namespace, j, keys[j])
            for e, arrays in enumerate(block.entries):
                parts[e][j] = [to_mlx(a) for a in arrays]
        state = None
        if self.layout.has_recurrent:
            j = n // self.B - 1
            block = self._decode(datas[-1], plan.ids[j], "state", plan.ids[j - 1] if j else self.namespace, j, keys[-1])
            state = [[to_mlx(a) for a in arrays] for arrays in block.entries]
        room = prompt_len - n + 256
        caches = [restore_entry(spec, parts[e], n, self.B, room, state[e] if state else None)
                  for e, spec in enumerate(self.layout.layers)]
        mx.eval([c.state for c in caches])
        return caches

    def _decode(self, data, block_id: bytes, kind: str, parent: bytes, index: int, key: bytes) -> Block:
        try:
            if data is None:
                raise block_format.Truncated("block vanished from the tiers between plan and restore")
            return block_format.decode(data, Expect(self.namespace, block_id, kind, self.described, self.B, parent))
        except BlockError as e:
            if data is not None:
                self.tier.discard(key, e)
            e.block_index = index
            raise

    # -- store ---------------------------------------------------------------
    def store_block(self, index: int, block_id: bytes, parent: bytes, tokens: list[int], caches: list) -> None:
        if self.tier.in_ram(block_id):
            return
        start = index * self.B
        entries = _host([capture_block(spec, cache, start, start + self.B, self.B)
                         for spec, cache in zip(self.layout.layers, caches)])
        self._put(block_id, "kv", block_id, parent, start, tokens, entries)
        self.counters.blocks_stored += 1

    def store_state(self, index: int, block_id: bytes, parent: bytes, tokens: list[int], state: list) -> None:
        key = state_key(block_id)
        if self.tier.in_ram(key):
            return
        self._put(key, "state", block_id, parent, index * self.B, tokens, _host(state))
        self.counters.checkpoints_stored += 1

    def snapshot_state(self, caches: list) -> list:
        return [capture_state(spec, cache) for spec, cache in zip(self.layout.layers, caches)]

    def _put(self, key: bytes, kind: str, block_id: bytes, parent: bytes, start: int, tokens, entries) -> None:
        block = Block(kind=kind, namespace=self.namespace, id=block_id, parent=parent, start=start,
                      tokens=np.asarray(tokens, dtype="<u4"), layout=self.described, dtype=self.dtype,
                      codec=self.codec, entries=entries)
        self.tier.put(key, block_format.encode(block))

    def stats(self) -> dict:
        return {"block_tokens": self.B, "checkpoint_every": self.every, **self.counters.as_dict(),
                **self.tier.stats()}


def _host(entries: list[list[mx.array]]) -> list[list]:
    """Evaluate every array of a block in one sync and view them from numpy."""
    flat = host_views([a for arrays in entries for a in arrays])
    out, i = [], 0
    for arrays in entries:
        out.append(flat[i:i + len(arrays)])
        i += len(arrays)
    return out


def checkpoint_interval(state_bytes: int, kv_bytes_per_block: int, overhead: float) -> int:
    """k such that one checkpoint per k blocks adds at most `overhead` x the KV bytes of those blocks."""
    if state_bytes <= 0:
        return 1
    if kv_bytes_per_block <= 0 or overhead <= 0:
        return 1 << 30  # only the mandatory end-of-prompt checkpoints
    return max(1, math.ceil(state_bytes / (overhead * kv_bytes_per_block)))


def layout_byte_sizes(layout: Layout, caches: list) -> tuple[int, int]:
    """(recurrent checkpoint bytes, KV bytes per token) measured from caches after a short prefill."""
    state = sum(a.nbytes for spec, c in zip(layout.layers, caches) if isinstance(spec, Recurrent) for a in c.cache)
    per_token = 0
    for spec, c in zip(layout.layers, caches):
        if isinstance(spec, Recurrent):
            continue
        keys, values = c.keys, c.values
        arrays = [*keys, *values] if isinstance(keys, tuple) else [keys, values]
        per_token += sum(a.nbytes // a.shape[2] for a in arrays)
    return state, per_token
