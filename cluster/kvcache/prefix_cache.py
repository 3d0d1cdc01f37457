"""PrefixCache: a replica's block cache for one model, as the model thread uses it.

It answers three questions for the engine:
- restore: build mlx-lm caches holding the prefix the admission stage fetched;
- store:   encode a finished block (or a recurrent checkpoint) into the tiers;
- expect:  what a block must look like at a place of a chain (namespace, id,
           parent, start, layout, dtype, codec, and every array's dtype and
           shape), so decoding refuses anything else.

Where to resume (plan.py) and fetching the blocks (admission.py) happen before
a sequence reaches the model thread; everything here runs on it, with no I/O.
A failure while restoring is a miss, whatever raised it: the blocks involved
are discarded from every tier, counted, and the prompt is prefilled cold.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional
import mlx.core as mx
import numpy as np

from cluster.config import CacheConfig
from cluster.engine.schedule import Schedule
from cluster.families.codecs import capture_block, capture_state, new_cache, restore_entry
from cluster.families.specs import Layout, Recurrent
from cluster.kvcache.payload_codec import TurboQuantPayload
from cluster.kvcache.plan import Planner
from cluster.kvcache.tiers import Tiers
from cluster.store import block_format
from cluster.store.arrays import host_views, to_mlx
from cluster.store.block_format import REASONS, Block, BlockError, Expect, Signature
from cluster.store.hashing import state_key

log = logging.getLogger(__name__)


@dataclass
class Prefetch:
    """What the admission stage hands the model thread: decoded, verified blocks and where to resume."""

    ids: list[bytes]  # every full block of the prompt
    n: int = 0  # tokens to restore
    blocks: dict = field(default_factory=dict)  # key -> decoded Block (numpy views), exactly planner.keys(ids, n)
    from_ram: int = 0
    from_disk: int = 0
    fetched: int = 0  # of the n tokens, how many come from blocks pulled from a peer
    fetched_from: Optional[str] = None


@dataclass
class CacheCounters:
    lookups: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    blocks_stored: int = 0
    checkpoints_stored: int = 0
    capture_errors: int = 0
    corrupt: dict = field(default_factory=lambda: {r: 0 for r in REASONS})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def refused(self, reason: str) -> None:
        with self._lock:
            self.corrupt[reason if reason in self.corrupt else "unexpected"] += 1

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "hit_requests": self.hit_requests, "hit_tokens": self.hit_tokens,
                "blocks_stored": self.blocks_stored, "checkpoints_stored": self.checkpoints_stored,
                "capture_errors": self.capture_errors, "corrupt": dict(self.corrupt)}


@dataclass(frozen=True)
class Shapes:
    """Measured from the model: payload signatures and byte sizes."""

    dtype: str
    kv: Signature  # what every KV block's arrays must be
    state: Signature  # what every checkpoint's arrays must be
    state_bytes: int = 0
    kv_bytes_per_token: int = 0


class PrefixCache:
    def __init__(self, layout: Layout, namespace: bytes, config: CacheConfig, tiers: Tiers, shapes: Shapes,
                 codec: list, payload: Optional[TurboQuantPayload] = None, schedule: Optional[Schedule] = None):
        self.layout = layout
        self.schedule = schedule or Schedule.of("block", config.block_tokens, config.block_tokens)
        self.namespace = namespace
        self.B = config.block_tokens
        self.tiers = tiers
        self.shapes = shapes
        self.dtype = shapes.dtype
        self.codec = codec
        self.payload = payload  # None: KV blocks hold the model's own arrays
        self.kv_arrays = payload.signature() if payload is not None else shapes.kv
        self.codec_quality: Optional[dict] = None
        # Packing costs CPU the model thread must not spend: KV blocks of a lossy codec are packed on a
        # thread of their own, and reach the tiers when packed (until then a lookup simply misses them).
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="mlx-fleet-pack") if payload is not None else None
        self._packing: set[bytes] = set()
        self._packing_lock = threading.Lock()
        # Payload bytes of one KV block as the tiers and peers hold it (what a pull moves).
        self.block_bytes = (_nbytes(self.kv_arrays) if payload is not None
                            else shapes.kv_bytes_per_token * config.block_tokens)
        self.described = layout.describe()
        self.planner = Planner(layout, self.B, self.schedule)
        self.every = checkpoint_interval(shapes.state_bytes, self.block_bytes,
                                         config.checkpoint_overhead)
        self.counters = CacheCounters()

    # -- what a block must be ------------------------------------------------------
    def expect(self, kind: str, index: int, ids: list[bytes]) -> Expect:
        """The block `kind` ("kv" or "state") at the end of block `index` of the chain `ids`."""
        return Expect(namespace=self.namespace, id=ids[index], kind=kind, layout=self.described,
                      block_tokens=self.B, parent=ids[index - 1] if index else self.namespace,
                      start=index * self.B, dtype=self.dtype, codec=self.codec,
                      arrays=self.kv_arrays if kind == "kv" else self.shapes.state)

    def decode(self, data, kind: str, index: int, ids: list[bytes]) -> Block:
        """Decode and check block `index` (or the checkpoint at its end) of the chain `ids`.

        No MLX here (the arrays are numpy views), so it runs off the model thread."""
        block = block_format.decode(data, self.expect(kind, index, ids))
        if kind == "kv" and self.payload is not None:
            block.entries = self.payload.decode(block.entries)
        return block

    # -- cold caches ---------------------------------------------------------
    def new_caches(self) -> list:
        return [new_cache(spec) for spec in self.layout.layers]

    def checkpoint_due(self, block_index: int, prompt_len: int) -> bool:
        """Every `every`-th block end, the prompt's last full block end (where the next turn
        resumes), and the last block end before the prompt's final token (where the very
        same prompt resumes: generation needs one token left to prefill).

        On the canonical schedule, only cut points: every `every` blocks' worth of chunks, and the last
        cut of the kept tokens (where the same prompt and its next turn resume)."""
        end = (block_index + 1) * self.B
        if self.schedule.canonical:
            C, kept = self.schedule.chunk_tokens, self.schedule.kept_tokens(prompt_len)
            return end % C == 0 and end <= kept and (end // C % -(-self.every * self.B // C) == 0 or end == kept)
        return ((block_index + 1) % self.every == 0 or block_index == prompt_len // self.B - 1
                or block_index == (prompt_len - 1) // self.B - 1)

    def kept_tokens(self, prompt_len: int) -> int:
        """Tokens [0, kept) of a sequence with this prompt whose blocks may serve a later hit.

        The schedule's rule (Schedule.kept_tokens), and on the block schedule, for a model with sliding
        windows, the prompt's prefilled tokens only: a decode step attends over the window's ring, rotated
        once it wraps, so it sums the same terms in another order than a prefill chunk does, and a reply's
        blocks (the last prompt token's too) differ from a cold prefill of them in the last bits."""
        kept = self.schedule.kept_tokens(prompt_len)
        if not self.schedule.canonical and self.layout.windows():
            kept = min(kept, prompt_len - 1)
        return kept

    # -- restore (model thread) ------------------------------------------------------
    def restore(self, prompt: list[int], prefetch: Prefetch) -> tuple[list, int, list[bytes]]:
        """Caches holding the fetched prefix of `prompt`, its length, and the prompt's block ids."""
        n = prefetch.n
        if n:
            try:
                caches = self._build(prefetch, n, len(prompt))
                self.counters.hit_requests += 1
                self.counters.hit_tokens += n
                return caches, n, prefetch.ids
            except Exception as e:  # any failure is a miss: never an answer, never a 500
                reason = e.reason if isinstance(e, BlockError) else "unexpected"
                log.warning("restoring %d cached tokens failed (%s: %s); prefilling cold and dropping its blocks",
                            n, type(e).__name__, e)
                self.counters.refused(reason)
                for key in self.planner.keys(prefetch.ids, n):
                    self.tiers.discard(key, reason, f"restore failed: {type(e).__name__}: {e}")
        return self.new_caches(), 0, prefetch.ids

    def _build(self, prefetch: Prefetch, n: int, prompt_len: int) -> list:
        m = math.ceil(n / self.B)
        parts: list[list] = [[None] * m for _ in self.layout.layers]
        for j in range(m):
            for e, arrays in enumerate(prefetch.blocks[prefetch.ids[j]].entries):
                parts[e][j] = [to_mlx(a) for a in arrays]
        state = None
        if self.layout.has_recurrent:
            block = prefetch.blocks[state_key(prefetch.ids[n // self.B - 1])]
            state = [[to_mlx(a) for a in arrays] for arrays in block.entries]
        capacity = self.schedule.capacity(n, prompt_len)
        caches = [restore_entry(spec, parts[e], n, self.B, capacity, state[e] if state else None)
                  for e, spec in enumerate(self.layout.layers)]
        mx.eval([c.state for c in caches])
        return caches

    # -- store (model thread) ---------------------------------------------------------------
    def store_block(self, index: int, block_id: bytes, parent: bytes, tokens: list[int], caches: list) -> None:
        if self.tiers.ram.present([block_id])[0] or block_id in self._packing:
            return
        start = index * self.B
        entries = host_entries([capture_block(spec, cache, start, start + self.B, self.B)
                         for spec, cache in zip(self.layout.layers, caches)])
        self._put(block_id, "kv", block_id, parent, start, tokens, entries)
        self.counters.blocks_stored += 1

    def store_state(self, index: int, block_id: bytes, parent: bytes, tokens: list[int], state: list) -> None:
        key = state_key(block_id)
        if self.tiers.ram.present([key])[0]:
            return
        self._put(key, "state", block_id, parent, index * self.B, tokens, host_entries(state))
        self.counters.checkpoints_stored += 1

    def snapshot_state(self, caches: list) -> list:
        return [capture_state(spec, cache) for spec, cache in zip(self.layout.layers, caches)]

    def _put(self, key: bytes, kind: str, block_id: bytes, parent: bytes, start: int, tokens, entries) -> None:
        block = Block(kind=kind, namespace=self.namespace, id=block_id, parent=parent, start=start,
                      tokens=np.asarray(tokens, dtype="<u4"), layout=self.described, dtype=self.dtype,
                      codec=self.codec, entries=entries)
        if kind == "kv" and self._packer is not None:
            with self._packing_lock:
                self._packing.add(key)
            self._packer.submit(self._pack_and_put, key, block)
        else:
            self.tiers.put(key, block_format.encode(block))

    def _pack_and_put(self, key: bytes, block: Block) -> None:
        """On the packing thread: the arrays are numpy views of evaluated buffers; no MLX call here."""
        try:
            block.entries = self.payload.encode(block.entries)
            self.tiers.put(key, block_format.encode(block))
        except Exception:  # a block not kept is a later miss, never a wrong answer
            log.exception("packing block %s failed; it is not cached", key.hex()[:16])
        finally:
            with self._packing_lock:
                self._packing.discard(key)

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every block captured so far is packed and in the tiers."""
        if self._packer is not None:
            self._packer.submit(lambda: None).result(timeout_s)

    def stats(self) -> dict:
        out = {"block_tokens": self.B, "checkpoint_every": self.every, "resume_at": self.schedule.mode,
               "chunk_tokens": self.schedule.chunk_tokens, **self.counters.as_dict(),
               **self.tiers.stats()}
        if self.codec_quality is not None:
            out["codec_quality"] = self.codec_quality
        return out


def _nbytes(signature: Signature) -> int:
    return sum(int(np.prod(shape)) * np.dtype(block_format.STORAGE[tag]).itemsize
               for arrays in signature for tag, shape in arrays)


def host_entries(entries: list[list[mx.array]]) -> list[list]:
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

