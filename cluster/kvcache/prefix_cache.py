"""PrefixCache: a replica's block cache for one model, as the model thread uses it.

It answers three questions for the engine:
- restore: build mlx-lm caches holding the prefix the admission stage fetched;
- store:   keep a finished block (or a recurrent checkpoint) in the tiers;
- expect:  what a block must look like at a place of a chain (namespace, id,
           parent, start, layout, dtype, codec, and every array's dtype and
           shape), so decoding refuses anything else.

With the model's own codec the RAM tier holds device blocks (device_blocks.py):
a capture is a device copy, a RAM hit is a concatenation per run with no host
copy and no check, and the envelope (encode, checksum) is made on the disk
client's thread when the block spills. A block read from the disk or pulled
from a peer is checked there (decode), and moved to the device once: a disk
read's blocks in batches while the rest is read (uploads.py), a pull's when
restored. From then on it is a RAM block like the others. With a packing
codec (tq*) the RAM tier holds the packed envelopes, packed on a thread of
their own and decoded on every hit.

Where to resume (plan.py) and fetching the blocks (admission.py) happen before
a sequence reaches the model thread; everything here runs on it, with no I/O.
A failure while restoring is a miss, whatever raised it: the blocks involved
are discarded from every tier, counted, and the prompt is prefilled cold.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional
import mlx.core as mx
import numpy as np

from cluster.config import CacheConfig
from cluster.engine import model_thread
from cluster.engine.schedule import Schedule, on_gpu
from cluster.families.codecs import capture_block, capture_state, new_cache, restore_entry
from cluster.families.specs import FullAttention, Layout, QuantizedAttention, Recurrent, SlidingWindow
from cluster.kvcache import device_blocks
from cluster.kvcache.costs import Costs
from cluster.kvcache.device_blocks import DeviceBlock
from cluster.kvcache.payload_codec import TurboQuantPayload
from cluster.kvcache.plan import Planner
from cluster.kvcache.spill import Spiller
from cluster.kvcache.tails import Tail, capture_tail
from cluster.kvcache.tiers import Tiers
from cluster.kvcache.uploads import UPLOAD_BYTES, Uploads, submitter
from cluster.store import block_format
from cluster.store.arrays import host_views
from cluster.store.block_format import REASONS, Block, BlockError, Expect, Signature
from cluster.store.hashing import state_key, tail_key

log = logging.getLogger(__name__)



@dataclass
class Prefetch:
    """What the admission stage hands the model thread: decoded, verified blocks and where to resume."""

    ids: list[bytes]  # every full block of the prompt
    n: int = 0  # tokens to restore
    # key -> a DeviceBlock (a RAM hit) or a decoded, checked Block of numpy views (a disk read, a peer's
    # block, an envelope tier's hit): exactly planner.keys(ids, n)
    blocks: dict = field(default_factory=dict)
    from_ram: int = 0
    from_disk: int = 0
    fetched: int = 0  # of the n tokens, how many come from blocks pulled from a peer
    fetched_from: Optional[str] = None
    tail: Optional[Tail] = None  # the prompt's tail (tails.py): n is then len(prompt) - 1


@dataclass
class CacheCounters:
    lookups: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    blocks_stored: int = 0
    checkpoints_stored: int = 0
    tails_stored: int = 0
    tail_hits: int = 0
    capture_errors: int = 0
    corrupt: dict = field(default_factory=lambda: {r: 0 for r in REASONS})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def refused(self, reason: str) -> None:
        with self._lock:
            self.corrupt[reason if reason in self.corrupt else "unexpected"] += 1

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "hit_requests": self.hit_requests, "hit_tokens": self.hit_tokens,
                "blocks_stored": self.blocks_stored, "checkpoints_stored": self.checkpoints_stored,
                "tails_stored": self.tails_stored, "tail_hits": self.tail_hits, "capture_errors": self.capture_errors, "corrupt": dict(self.corrupt)}


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
        self.device = tiers.device  # RAM holds device blocks (else envelopes, for a packing codec)
        self.tails = self.device and self.schedule.canonical  # keep prompts' partial last chunks (tails.py)
        self.runs = {"kv": device_blocks.runs_of(shapes.kv), "state": device_blocks.runs_of(shapes.state)}
        # Per kind, per entry: (run, member) of each of its arrays. A run is concatenated over blocks in one
        # op when every member is a full-length K/V (a sliding window's tail is not).
        self._where = {kind: [[] for _ in layout.layers] for kind in self.runs}
        for kind, runs in self.runs.items():
            for r, run in enumerate(runs):
                for i, (e, _) in enumerate(run.members):
                    self._where[kind][e].append((r, i))
        self._merge = [all(isinstance(layout.layers[e], (FullAttention, QuantizedAttention)) for e, _ in run.members)
                       for run in self.runs["kv"]]
        # How copies are batched. A GPU pays per kernel launch (a concatenate launches one copy per input):
        # there a restore concatenates each run over the blocks first, and a capture copies a forward's whole
        # span at once, for a few hundred launches where per-layer copies would take thousands. A CPU pays
        # per byte: there each layer is built straight from the blocks and each block captured on its own,
        # one copy of every byte. Both give the same arrays.
        self.few_launches = on_gpu()
        self._unsealed: list[tuple[bytes, DeviceBlock]] = []
        self.spiller = Spiller(tiers, self.runs, len(layout.layers), self._envelope)  # spill.py
        if self.device:
            tiers.spill = self.spiller.evicted
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
        self.costs = Costs(overlap_bytes=UPLOAD_BYTES if self.device else 0)  # the replica sets its prefill_tps
        self._moved = 0  # bytes of blocks read in and moved to the device by the restore being built
        # The model thread's queue (the replica's scheduler): blocks read from the disk move to the device there
        # while later ones are read (uploads.py). None: only where the admission runs on the model thread.
        self.device_work: Optional[Callable[[Callable[[], object]], Future]] = None

    # -- what a block must be ------------------------------------------------------
    def expect(self, kind: str, index: int, ids: list[bytes]) -> Expect:
        """The block `kind` ("kv" or "state") at the end of block `index` of the chain `ids`."""
        return Expect(namespace=self.namespace, id=ids[index], kind=kind, layout=self.described,
                      block_tokens=self.B, parent=ids[index - 1] if index else self.namespace,
                      start=index * self.B, dtype=self.dtype, codec=self.codec,
                      arrays=self.kv_arrays if kind == "kv" else self.shapes.state)

    def decode(self, data, kind: str, index: int, ids: list[bytes], payload_verified: bool = False) -> Block:
        """Decode and check block `index` (or the checkpoint at its end) of the chain `ids`.

        No MLX here (the arrays are numpy views), so it runs off the model thread. `payload_verified`: a disk
        read checked this buffer's payload checksum already (block_format.decode)."""
        block = block_format.decode(data, self.expect(kind, index, ids), payload_verified)
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
                self.counters.tail_hits += prefetch.tail is not None
                return caches, n, prefetch.ids
            except Exception as e:  # any failure is a miss: never an answer, never a 500
                reason = e.reason if isinstance(e, BlockError) else "unexpected"
                log.warning("restoring %d cached tokens failed (%s: %s); prefilling cold and dropping its blocks",
                            n, type(e).__name__, e)
                self.counters.refused(reason)
                for key in [*prefetch.blocks, *([prefetch.tail.id] if prefetch.tail else [])]:
                    self.spiller.drop(key)
                    self.tiers.discard(key, reason, f"restore failed: {type(e).__name__}: {e}")
        return self.new_caches(), 0, prefetch.ids

    def _build(self, prefetch: Prefetch, n: int, prompt_len: int) -> list:
        t0, self._moved = time.perf_counter(), 0
        tail = prefetch.tail
        upto = tail.start if tail is not None else n  # tokens from blocks; a tail holds the rest
        m = math.ceil(upto / self.B)
        # The RAM tier's speed is sampled on builds from RAM alone: blocks the admission just moved from the disk
        # are device blocks too, but a first build over them can be slower (fresh memory) and is the disk's.
        resident = not prefetch.from_disk and all(isinstance(prefetch.blocks[prefetch.ids[j]], DeviceBlock)
                                                  for j in range(m))
        wanted = [(prefetch.ids[j], "kv") for j in range(m)]
        if self.layout.has_recurrent and tail is None:
            wanted.append((state_key(prefetch.ids[n // self.B - 1]), "state"))
        on_device = self._on_device([(key, prefetch.blocks[key], kind) for key, kind in wanted])
        blocks, state = on_device[:m], (on_device[m] if len(on_device) > m else None)
        # One concatenation per mergeable run, over all m blocks: [members, 1, H, m * B, D].
        merged = [_merge_run(blocks, r) if ok and self.few_launches and m else None
                  for r, ok in enumerate(self._merge)]
        capacity = self.schedule.capacity(n, prompt_len)
        caches = []
        for e, spec in enumerate(self.layout.layers):
            rest = [tail.entry(e)] if tail is not None else []
            if isinstance(spec, Recurrent):
                arrays = rest[0] if tail is not None else [state.member(r, i) for r, i in self._where["state"][e]]
                caches.append(restore_entry(spec, [], n, self.B, capacity, arrays))
            elif isinstance(spec, SlidingWindow) and tail is not None:  # the tail holds the whole window
                caches.append(restore_entry(spec, rest, n, n, capacity))
            elif m and all(merged[r] is not None for r, _ in self._where["kv"][e]):
                whole = [merged[r](i) for r, i in self._where["kv"][e]]
                caches.append(restore_entry(spec, [whole] + rest, n, self.B, capacity))  # m blocks as one part
            else:
                first = max(0, (n - spec.window) // self.B - 1) if isinstance(spec, SlidingWindow) else 0
                parts = [None] * first + [[b.member(r, i) for r, i in self._where["kv"][e]] for b in blocks[first:]]
                caches.append(restore_entry(spec, parts + rest, n, self.B, capacity))
        mx.eval([c.state for c in caches])
        if self._moved:  # bytes read in, moved to the device: the build's time is theirs (on CUDA, migrating
            # managed pages at their first use, in the concatenation, is most of it; device copies are ~1 ms)
            self.costs.observe("move", self._moved, time.perf_counter() - t0)
            self._moved = 0
        if resident:  # the RAM tier's speed: what the restore-or-recompute choice predicts with
            moved = sum(b.nbytes for b in blocks) + (tail.nbytes if tail is not None else 0)
            self.costs.observe("ram", moved, time.perf_counter() - t0)
        return caches

    def _on_device(self, fetched: list[tuple[bytes, object, str]]) -> list[DeviceBlock]:
        """Fetched blocks ((key, block, kind) each) as device blocks: those the admission did not move already
        (uploads.py) move now, together, once."""
        host = [(i, key, block, kind) for i, (key, block, kind) in enumerate(fetched)
                if not isinstance(block, DeviceBlock)]
        out = [block for _, block, _ in fetched]
        if not host:
            return out
        for (i, *_), block in zip(host, self.to_device([(key, block, kind) for _, key, block, kind in host])):
            out[i] = block
            self._moved += block.nbytes
        return out

    def to_device(self, blocks: list[tuple[bytes, Block, str]]) -> list[DeviceBlock]:
        """Blocks read from the disk or pulled from a peer (checked by decode; (key, block, kind) each) moved to
        the device together, and into a device RAM tier: the next hit finds them there. Model thread."""
        model_thread.check("PrefixCache.to_device")
        moved = device_blocks.from_host([block for _, block, _ in blocks], [self.runs[kind] for *_, kind in blocks])
        mx.eval([a for b in moved for a in b.runs])  # whole before the tier holds them
        if self.device:
            for (key, _, _), block in zip(blocks, moved):
                self.tiers.ram.put(key, block)
        return moved

    def uploads(self, moved: Callable[[bytes, DeviceBlock], None]) -> Optional[Uploads]:
        """Batched moves for one admission read, overlapping the reads (uploads.py), each moved block handed to
        `moved`; None where the restore moves the blocks (a RAM tier of envelopes, or no way to the model thread
        from this thread)."""
        submit = submitter(self.device_work)
        if not self.device or submit is None:
            return None
        return Uploads(self._timed_to_device, submit, moved)

    def _timed_to_device(self, blocks: list[tuple[bytes, Block, str]]) -> list[DeviceBlock]:
        """to_device for an admission's batch, its speed measured (the restore times its own moves)."""
        t0 = time.perf_counter()
        moved = self.to_device(blocks)
        self.costs.observe("move", sum(b.nbytes for b in moved), time.perf_counter() - t0)
        return moved

    # -- store (model thread) ---------------------------------------------------------------
    def store_block(self, index: int, block_id: bytes, parent: bytes, tokens: list[int], caches: list) -> None:
        if self.tiers.ram.present([block_id])[0] or block_id in self._packing:
            return
        start = index * self.B
        arrays = [capture_block(spec, cache, start, start + self.B, self.B)
                  for spec, cache in zip(self.layout.layers, caches)]
        if self.device:
            self._keep(block_id, device_blocks.capture("kv", block_id, parent, start, tokens, arrays,
                                                       self.runs["kv"]))
        else:
            self._put(block_id, "kv", block_id, parent, start, tokens, host_entries(arrays))
        self.counters.blocks_stored += 1

    def store_blocks(self, first: int, heads: list[tuple[bytes, bytes, list[int]]], caches: list) -> None:
        """KV blocks first, first + 1, ... that one forward completed ((id, parent, tokens) each): on a device
        tier captured together, one slice per array for the whole span (device_blocks.capture_span), where
        every layer holds the span whole; else one by one."""
        todo = [(first + i, *head) for i, head in enumerate(heads)
                if not self.tiers.ram.present([head[0]])[0] and head[0] not in self._packing]
        if not todo:
            return
        start, end = todo[0][0] * self.B, (todo[-1][0] + 1) * self.B
        whole = all(spec.window >= end - start for spec in self.layout.layers if isinstance(spec, SlidingWindow))
        if not self.device or not self.few_launches or len(todo) < 2 or not whole:
            for index, block_id, parent, tokens in todo:
                self.store_block(index, block_id, parent, tokens, caches)
            return
        arrays = [capture_block(spec, cache, start, end, end - start) for spec, cache in zip(self.layout.layers, caches)]
        blocks = device_blocks.capture_span([(block_id, parent, index * self.B, tokens)
                                             for index, block_id, parent, tokens in todo],
                                            arrays, self.runs["kv"], self.B)
        for block in blocks:
            self._keep(block.id, block)
        self.counters.blocks_stored += len(blocks)

    def store_state(self, index: int, block_id: bytes, parent: bytes, tokens: list[int], state: list) -> None:
        key = state_key(block_id)
        if self.tiers.ram.present([key])[0]:
            return
        if self.device:
            self._keep(key, device_blocks.capture("state", block_id, parent, index * self.B, tokens, state,
                                                  self.runs["state"]))
        else:
            self._put(key, "state", block_id, parent, index * self.B, tokens, host_entries(state))
        self.counters.checkpoints_stored += 1

    def store_tail(self, prompt: list[int], ids: list[bytes], caches: list) -> None:
        """Keep the prompt's tail (tails.py) once every prompt token but the last is in `caches`."""
        where = self._tail_of(prompt, ids)
        if where is None or self.tiers.ram.present([where[0]])[0]:
            return
        key, parent, start = where
        self._keep(key, capture_tail(self.layout, caches, key, parent, start, prompt[start:len(prompt) - 1]))
        self.counters.tails_stored += 1

    def tail_for(self, prompt: list[int], ids: list[bytes]) -> Optional[Tail]:
        """The prompt's tail, if RAM holds it (admission threads: a reference, no MLX). Not counted as a use:
        the plan may not take it (Admission counts the one it takes)."""
        where = self._tail_of(prompt, ids)
        held = self.tiers.ram.peek(where[0]) if where is not None else None
        return held if isinstance(held, Tail) else None

    def _tail_of(self, prompt: list[int], ids: list[bytes]) -> Optional[tuple[bytes, bytes, int]]:
        """(key, parent block id, start) of the prompt's tail; None where this cache keeps none for it."""
        start, end = self.kept_tokens(len(prompt)), len(prompt) - 1
        if not self.tails or end <= start or (end - start == 1 and self.layout.windows()):
            return None  # (a one-token chunk rotates a sliding window's ring: tails.py)
        parent = ids[start // self.B - 1] if start else self.namespace
        return tail_key(parent, prompt[start:end]), parent, start

    def _keep(self, key: bytes, block: DeviceBlock) -> None:
        """Into the device RAM tier; evaluated by the next seal()."""
        self._unsealed.append((key, block))
        self.tiers.ram.put(key, block)

    def seal(self) -> None:
        """Evaluate the blocks captured since the last seal (one sync), and spill those the disk lacks (or queue
        them for idle: spill.py). The session calls it after each forward's captures (model thread)."""
        if self._unsealed:
            blocks, self._unsealed = self._unsealed, []
            device_blocks.seal([b for _, b in blocks])
            disk = self.tiers.disk
            if disk is not None:
                self.spiller.spill([(k, b) for k, b in blocks if b.kind != "tail" and not disk.holds(k)])
        self.spiller.overdue()

    @property
    def spill_when_idle(self) -> bool:
        """Whether spills wait for the model thread to be idle (a replica's scheduler calls spill_idle then)."""
        return self.spiller.when_idle

    @spill_when_idle.setter
    def spill_when_idle(self, value: bool) -> None:
        self.spiller.when_idle = value

    def spill_idle(self) -> bool:
        """Model thread, no sequence in flight: the backlog's next batch to the disk; whether a backlog is left."""
        return self.spiller.idle()

    def backlog(self) -> dict:
        return self.spiller.backlog()

    def _envelope(self, block: DeviceBlock, entries: list) -> memoryview:
        return block_format.encode(Block(kind=block.kind, namespace=self.namespace, id=block.id, parent=block.parent,
                                         start=block.start, tokens=block.tokens, layout=self.described,
                                         dtype=self.dtype, codec=self.codec, entries=entries))

    def envelope(self, key: bytes) -> Optional[memoryview]:
        """The envelope of a block RAM holds, as it would leave this process (tests, tools)."""
        held = self.tiers.ram.get(key)
        if held is None or not isinstance(held, DeviceBlock):
            return held
        return self._envelope(held, self.spiller.host_entries([held])[0])

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
               **self.tiers.stats(), "costs": self.costs.stats()}
        if self.tiers.disk is not None and self.device:
            out["spill_backlog"] = self.backlog()
        if self.codec_quality is not None:
            out["codec_quality"] = self.codec_quality
        return out


MAX_ELEMENTS = (1 << 31) - 1  # MLX's CUDA kernels index an array with 32-bit integers


def _merge_run(blocks: list[DeviceBlock], r: int) -> Callable[[int], mx.array]:
    """Run r of the blocks concatenated over them (token axis 3), as member i -> its [1, H, m * B, D] view.

    In groups of members small enough to index: at 32k tokens an 8B model's run is 2.4e9 elements, and
    on CUDA one such array is read out of bounds (an illegal memory access, on the H200)."""
    first = blocks[0].runs[r]
    per_member = first[0].size * len(blocks)
    g = max(1, min(first.shape[0], MAX_ELEMENTS // per_member))
    groups = [first[lo:lo + g] if len(blocks) == 1 else mx.concatenate([b.runs[r][lo:lo + g] for b in blocks], axis=3)
              for lo in range(0, first.shape[0], g)]
    return lambda i: mx.squeeze(groups[i // g][i % g:i % g + 1], 0)


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
