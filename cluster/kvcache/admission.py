"""Admission: find and fetch a prompt's cached prefix before the sequence joins the model thread.

The model thread must never wait on Ray or the disk: one slow store would stall
every sequence decoding on it. So every lookup and read happens here, on an
admission thread, and the model thread receives ready, verified blocks.

    chain ids -> which leading blocks RAM, then the disk, hold (one lookup each)
              -> (hybrids) which checkpoints exist
              -> the prompt's tail, if RAM holds it (tails.py): then n = len(prompt) - 1
              -> plan n -> read what n needs (RAM, then one batched disk read)
              -> decode and check every block that crossed the process boundary (disk,
                 peer) against the model (shape, dtype, ...); a RAM hit is a device
                 block this process made, taken as it is
              -> a refused or unreadable block shrinks the plan; retry with what is left

Migration: when the route plan says a peer holds more of the prefix than this
node (and pulling beats recomputing), the missing blocks are pulled from the
peer's node store first (peers.py), checked like any other block, and kept:
into RAM, through to this node's disk, announced in the fleet index. A failed
or late pull only shortens the prefix; the rest is recomputed.

Restore or recompute: before reading, the plan's bytes by tier and the tokens
it saves are weighed against recomputing them, with the replica's own measured
speeds (costs.py); when recomputing is predicted faster, the prompt is
prefilled cold. Where that prediction read the disk at the spills' write speed
(no read measured yet) or on a stale read speed (costs.RESAMPLE_S), the plan's first
disk blocks (about SAMPLE_BYTES) are read in the background, off the request's path,
so the next choice has a measured, recent read speed.

Bounds: each store call has its own timeout and goes through a circuit breaker
(disk_client.py), a pull has its deadline, and the whole stage has one
(`fetch_async`): past it the request is simply prefilled cold. A block refused
here is discarded from every tier and counted by reason, like one refused on
the model thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Executor
from typing import Optional, Protocol

from cluster.kvcache.costs import MIN_BYTES
from cluster.kvcache.device_blocks import DeviceBlock
from cluster.kvcache.disk_client import Taken
from cluster.kvcache.peers import PeerClient
from cluster.kvcache.prefix_cache import Prefetch, PrefixCache
from cluster.store.block_format import BlockError
from cluster.store.contract import leading
from cluster.store.hashing import chain_ids, state_key

log = logging.getLogger(__name__)

ROUNDS = 4  # plan -> fetch attempts; each failed one strictly shrinks the plan
ADMISSION_THREADS = 4  # a replica's (and a sharded replica's follower's) reads at once
# A sample read's bytes (about: whole blocks, the last one may pass it): enough to measure a disk's bandwidth,
# little enough not to slow the recompute it runs beside (all 4.8 GB of a 32k-token 8B prompt made that
# recompute 22% slower on an H100). A plan with less than costs.MIN_BYTES on the disk is not sampled: a
# transfer that small would not be measured.
SAMPLE_BYTES = 256 << 20
SAMPLE_THREAD = "mlx-fleet-disk-sample"


class FetchPlan(Protocol):
    """The part of a route plan (actors/plan.py) that says what to pull from which peer."""

    peer: str
    end_block: int
    checkpoint: bool
    nbytes: int


class Admission:
    def __init__(self, cache: PrefixCache, executor: Optional[Executor] = None, deadline_s: float = 15.0,
                 peers: Optional[PeerClient] = None, fetch_timeout_s: float = 10.0):
        self.cache = cache
        self.executor = executor
        self.deadline_s = deadline_s
        self.peers = peers
        self.fetch_timeout_s = fetch_timeout_s
        self.timeouts = 0
        self._sampling = threading.Lock()  # held while a sample read runs (one at a time)

    async def fetch_async(self, prompt: list[int], pull: Optional[FetchPlan] = None) -> Prefetch:
        """`fetch` on the admission executor, bounded by the stage deadline; any trouble means cold."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.executor, self.fetch, prompt, pull),
                                          self.deadline_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            log.warning("admission took longer than %.1fs; prefilling cold", self.deadline_s)
        except Exception:  # never fail a request because its cache lookup failed
            log.exception("admission failed; prefilling cold")
        return Prefetch(ids=chain_ids(self.cache.namespace, prompt, self.cache.B))

    def fetch(self, prompt: list[int], pull: Optional[FetchPlan] = None, choose: bool = True) -> Prefetch:
        """Look up, (pull,) read and decode the longest restorable prefix of `prompt` (blocking; not on the
        model thread). `pull`: the route plan's peer fetch, if any. `choose`: cold where recomputing is
        predicted faster (a sharded replica's follower leaves that choice to its leader)."""
        pc, planner = self.cache, self.cache.planner
        pc.counters.lookups += 1
        ids = chain_ids(pc.namespace, prompt, pc.B)
        want = ids[:planner.usable_blocks(len(prompt))]
        hit = self._leading(want)
        blocks: dict = {}
        own, pulled_from = hit, None
        pulled_end = hit  # blocks [own, pulled_end) came from the peer
        if pull is not None and self.peers is not None and pull.end_block > hit:
            got = self._pull(pull, ids, hit, blocks)
            if got:  # held here now (a device tier gets them on restore): what follows may be local too
                hit = pulled_end = hit + got
                pulled_from = pull.peer
                hit += self._leading(want[hit:]) if hit < len(want) else 0
        checkpoints = self._checkpoints(ids, len(prompt), hit, blocks)
        tail = pc.tail_for(prompt, ids)
        sources = {"ram": 0, "disk": 0}
        for round_ in range(ROUNDS):
            if tail is not None and hit * pc.B >= tail.start:  # the very same prompt: every token but the last
                n, reads = len(prompt) - 1, [("kv", j, ids[j]) for j in range(tail.start // pc.B)]
            else:
                tail = None
                n = planner.best(len(prompt), hit, checkpoints)
                if not n:
                    break
                reads = planner.reads(ids, n)
            unread = [r for r in reads if r[2] not in blocks]
            if choose and round_ == 0 and not self._restore_pays(len(prompt), n, unread,
                                                                 tail.nbytes if tail is not None else 0):
                self._sample_read(unread)
                break  # recomputing is predicted faster (costs.py): cold
            bad = self._fetch(unread, ids, blocks, sources)
            if not bad:
                if tail is not None:
                    pc.tiers.ram.get(tail.id)  # a use: counted, and fresh in the LRU order
                # The peer's tokens only: blocks after the pulled ones may be this node's own (a concurrent
                # request may have stored them since the first lookup).
                fetched = max(0, min(n, pulled_end * pc.B) - own * pc.B) if pulled_from else 0
                return Prefetch(ids=ids, n=n, blocks={k: blocks[k] for _, _, k in reads},
                                from_ram=sources["ram"], from_disk=sources["disk"], fetched=fetched,
                                fetched_from=pulled_from if fetched else None, tail=tail)
            for kind, j in bad:  # shrink: nothing at or after a bad block, no bad checkpoint
                if kind == "kv":
                    hit = min(hit, j)
                else:
                    checkpoints.discard(j + 1)
        return Prefetch(ids=ids)

    def fetch_own(self, prompt: list[int], pull: Optional[FetchPlan] = None) -> Prefetch:
        """A sharded replica's follower's read (admission threads): the longest prefix its tiers hold (after
        `pull`, its part of the leader's route plan), read and decoded, with no restore-or-recompute choice (the
        leader makes it); the ranks then agree (shard_restore.py)."""
        return self.fetch(prompt, pull, choose=False)

    def restorable(self, prompt: list[int], disk: bool = True) -> int:
        """The most tokens of `prompt` this process's tiers (`disk`: its disk too) could restore (its tail's, or
        its blocks' with a checkpoint where needed), without reading any: a rank's offer when a sharded
        replica's ranks agree on what they all restore (shard_restore.py)."""
        pc, planner = self.cache, self.cache.planner
        ids = chain_ids(pc.namespace, prompt, pc.B)
        hit = self._leading(ids[:planner.usable_blocks(len(prompt))], disk=disk)
        tail = pc.tail_for(prompt, ids)
        if tail is not None and hit * pc.B >= tail.start:
            return len(prompt) - 1
        return planner.best(len(prompt), hit, self._checkpoints(ids, len(prompt), hit, {}, disk=disk))

    def fetch_exactly(self, prompt: list[int], n: int, have: Optional[dict] = None) -> Prefetch:
        """`prompt`'s first n tokens from the blocks a read already brought (`have`, by key) and RAM, or nothing
        (the result's n is 0): a rank of a sharded replica restores what the ranks agreed on or nothing, never
        another length. Model thread: never the disk (what the disk held, this rank's read brought), no
        restore-or-recompute choice (the leader made it) and no pull."""
        pc, planner = self.cache, self.cache.planner
        ids = chain_ids(pc.namespace, prompt, pc.B)
        if n <= 0:
            return Prefetch(ids=ids)
        blocks = dict(have or {})
        hit = self._leading(ids[:planner.usable_blocks(len(prompt))], disk=False, have=blocks)
        tail = pc.tail_for(prompt, ids) if n == len(prompt) - 1 else None
        if tail is not None and hit * pc.B >= tail.start:
            reads = [("kv", j, ids[j]) for j in range(tail.start // pc.B)]
        elif n in planner.candidates(len(prompt), hit) and \
                planner.restorable(n, self._checkpoints(ids, len(prompt), hit, blocks, disk=False)):
            tail, reads = None, planner.reads(ids, n)
        else:
            return Prefetch(ids=ids)
        sources = {"ram": 0, "disk": 0}
        if self._fetch([r for r in reads if r[2] not in blocks], ids, blocks, sources, disk=False):
            return Prefetch(ids=ids)
        if tail is not None:
            pc.tiers.ram.get(tail.id)
        return Prefetch(ids=ids, n=n, blocks={k: blocks[k] for _, _, k in reads}, from_ram=sources["ram"],
                        from_disk=sources["disk"], tail=tail)

    # -----------------------------------------------------------------------------------
    def _restore_pays(self, prompt_len: int, n: int, reads: list[tuple[str, int, bytes]], tail_bytes: int = 0) -> bool:
        """The restore-or-recompute choice for a plan, by the bytes each tier would move (a tail's: RAM)."""
        pc = self.cache
        in_ram = pc.tiers.ram.present([k for _, _, k in reads])
        size = {"kv": pc.block_bytes, "state": pc.shapes.state_bytes}
        ram = tail_bytes + sum(size[kind] for (kind, _, _), held in zip(reads, in_ram) if held)
        disk = sum(size[kind] for (kind, _, _), held in zip(reads, in_ram) if not held)
        return pc.costs.restore_pays(prompt_len, n, ram, disk)

    def _sample_read(self, reads: list[tuple[str, int, bytes]]) -> None:
        """After a recompute chosen with the disk's read speed unmeasured (the write speed stood in) or stale: read the
        plan's first disk blocks (SAMPLE_BYTES) on a thread of their own, off this request's path, and measure
        the read. One at a time; the bytes are let go (the request is already prefilling cold)."""
        pc = self.cache
        if pc.tiers.disk is None or not pc.costs.read_worth_sampling():
            return
        size = {"kv": pc.block_bytes, "state": pc.shapes.state_bytes}
        keys, nbytes = [], 0
        for (kind, _, key), held in zip(reads, pc.tiers.ram.present([k for _, _, k in reads])):
            if not held and nbytes < SAMPLE_BYTES:
                keys.append(key)
                nbytes += size[kind]
        if nbytes < MIN_BYTES or not self._sampling.acquire(blocking=False):
            return

        def run():
            try:
                self._read_disk(keys, sample=True)
            except Exception:  # a measurement: never a failure anyone sees
                log.exception("sample read of the disk failed")
            finally:
                self._sampling.release()

        try:
            threading.Thread(target=run, name=SAMPLE_THREAD, daemon=True).start()
        except RuntimeError:  # no thread to be had: no sample this time, and the next may try
            self._sampling.release()

    def _read_disk(self, keys: list[bytes], sample: bool = False, arrived=None) -> list:
        """Read `keys` from the disk (DiskClient.get_many) and fold the read's speed into the cost model (the reads'
        own time: moves made beside them are the move's)."""
        timing: dict = {}
        read = self.cache.tiers.disk.get_many(keys, sample=sample, arrived=arrived, timing=timing)
        self.cache.costs.observe("disk", sum(len(d) for d in read if d is not None), timing["read_s"])
        return read

    def _pull(self, plan: FetchPlan, ids: list[bytes], have: int, blocks: dict) -> int:
        """Pull blocks [have, plan.end_block) (and its checkpoint) from the peer; keep what verifies.

        Returns how many arrived good. They go into RAM (and through to this node's disk, and so into
        the index); the decoded ones into `blocks`, so they are not decoded twice."""
        pc = self.cache
        end = min(plan.end_block, len(ids))
        reads = [("kv", j, ids[j]) for j in range(have, end)]
        if pc.layout.has_recurrent and end:  # this process's layers say (a pipeline rank's may differ from its leader's)
            reads.append(("state", end - 1, state_key(ids[end - 1])))
        datas = self.peers.fetch(plan.peer, [k for _, _, k in reads], plan.nbytes // max(len(reads), 1),
                                 self.fetch_timeout_s)
        good = 0
        for (kind, j, key), data in zip(reads, datas):
            if data is None:
                break
            try:
                blocks[key] = pc.decode(data, kind, j, ids)
            except Exception as e:  # a peer's block that does not fit: refused like any other
                reason = e.reason if isinstance(e, BlockError) else "unexpected"
                log.warning("block %d pulled from %s refused (%s): %s", j, plan.peer, reason, e)
                pc.counters.refused(reason)
                break
            pc.tiers.arrived(key, data)
            good += 1
        return good

    def _leading(self, keys: list[bytes], disk: bool = True, have: Optional[dict] = None) -> int:
        """Leading blocks held by RAM (or read already: `have`), then continued by the disk (`disk`)."""
        tiers = self.cache.tiers
        hit = leading([held or k in (have or ()) for k, held in zip(keys, tiers.ram.present(keys))])
        if disk and tiers.disk is not None and hit < len(keys):
            hit += leading(tiers.disk.present(keys[hit:]))
        return hit

    def _checkpoints(self, ids: list[bytes], prompt_len: int, hit: int, blocks: dict, disk: bool = True) -> set[int]:
        """Block counts j whose end-of-block checkpoint some tier (`disk`: the disk too) holds, or a read or pull
        brought (`blocks`)."""
        ends = self.cache.planner.checkpoint_ends(prompt_len, hit)
        if not ends:
            return set()
        keys = [state_key(ids[j - 1]) for j in ends]
        found = [f or k in blocks for k, f in zip(keys, self.cache.tiers.ram.present(keys))]
        store = self.cache.tiers.disk if disk else None
        missing = [i for i, f in enumerate(found) if not f]
        if store is not None and missing:
            for i, f in zip(missing, store.present([keys[i] for i in missing])):
                found[i] = f
        return {j for j, f in zip(ends, found) if f}

    def _fetch(self, reads: list[tuple[str, int, bytes]], ids: list[bytes], blocks: dict,
               sources: dict, disk: bool = True) -> list[tuple[str, int]]:
        """Read (`disk`: RAM, then the disk) and decode `reads` into `blocks`; return the (kind, index) of
        those that failed."""
        tiers, pc = self.cache.tiers, self.cache
        keys = [k for _, _, k in reads]
        datas = tiers.ram.get_many(keys)
        in_ram = [k for k, d in zip(keys, datas) if d is not None]
        sources["ram"] += len(in_ram)
        missing = [i for i, d in enumerate(datas) if d is None]
        read_in: set[bytes] = set()  # read from the disk now: payload checksums verified by the read
        decoded: dict[bytes, object] = {}  # read from the disk and decoded as they arrived: a Block, or why not
        if tiers.disk is not None:
            tiers.disk.touch(in_ram)  # RAM hits keep the disk copies hot too (queued: no store call here)
            if missing and disk:
                uploads = pc.uploads(decoded.__setitem__)  # None: the restore moves them to the device

                def arrived(i: int, data) -> Taken:  # decoded now, moved while the rest is read, then let go
                    kind, j, key = reads[missing[i]]
                    try:
                        decoded[key] = block = pc.decode(data, kind, j, ids, payload_verified=True)
                    except Exception as e:  # refused below, with the others
                        decoded[key] = e
                    else:
                        uploads.add(key, block, kind, len(data))
                    return Taken(len(data))

                read = self._read_disk([keys[i] for i in missing], arrived=arrived if uploads is not None else None)
                if uploads is not None:
                    uploads.finish()
                for i, data in zip(missing, read):
                    if data is not None:
                        datas[i] = data
                        read_in.add(keys[i])
                        sources["disk"] += 1
                        if not tiers.device:  # promoted (a device tier's on restore): the next turn finds it in RAM
                            tiers.ram.put(keys[i], data)
        bad = []
        for (kind, j, key), data in zip(reads, datas):
            if data is None:
                bad.append((kind, j))
                continue
            if isinstance(data, DeviceBlock):  # made by this process from its own caches: nothing to check
                blocks[key] = data
                continue
            try:
                done = decoded.get(key)
                if isinstance(done, Exception):
                    raise done
                blocks[key] = done if done is not None else pc.decode(data, kind, j, ids, payload_verified=key in read_in)
            except Exception as e:  # any failure is a miss; a well-formed but wrong block is refused too
                reason = e.reason if isinstance(e, BlockError) else "unexpected"
                log.warning("cached block %d (%s) refused (%s): %s; treating it as a miss", j, kind, reason, e)
                pc.counters.refused(reason)
                tiers.discard(key, reason, str(e))
                bad.append((kind, j))
        return bad
