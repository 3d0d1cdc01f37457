"""One rank of a two-process sharded model, for tests/engine/test_lockstep.py.

    python -m tests.engine.lockstep_rank RANK HOSTFILE MODEL DATA_DIR OUT.json [MODE [LEADER]]

Each rank starts MLX's ring backend over loopback, loads the built-in MODEL and shards it (MODE: tensor,
the default, or pipeline parallel) on its scheduler's model thread, then joins the lockstep. The leader
(rank LEADER, 0 by default: a replica leads whatever its rank) serves the requests below (every request
at once, batched; one sampled without a seed; one cancelled after its third token), and, before
sharding, runs each greedy one alone on the whole model as the reference. Every rank writes what each
request generated, so the test can check that the ranks agree token for token.

Then the prefix cache, each rank its own (RAM, its own heads, its rank in the fingerprint): the leader
serves one prompt cold, again (restored on both ranks), and a third time after the follower has dropped
its blocks (it does so when the leader tells it the prompt is coming, before it reads): the ranks then agree
on nothing and both prefill cold. Before each, the leader tells the follower the prompt (`read_ahead`), as a
replica's admission does, and the follower reads its blocks on admission threads of its own.

Then migration, rank to rank: a second cache on each rank (a "peer replica" of the same geometry, with a
disk) serves the prompt once and writes its blocks to its store; a third, empty one (a "fresh replica")
serves it with a route plan that pulls from the peer, whose rank r is at node `peer-r{r}`. Each rank pulls its
own heads' blocks from its counterpart (FetchPlan.for_rank), the leader at admission and the follower in its
read, and both restore them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GREEDY = 10
PROMPT_LENGTHS = [24, 70, 5, 140, 33, 1, 90, 47, 120, 12]
CACHED_PROMPT = [3 + (i * 6151) % 1021 for i in range(150)]


def prompt_of(n: int, salt: int) -> list[int]:
    return [3 + (i * 7919 + salt * 104729) % 1021 for i in range(n)]


def main() -> int:
    rank, hostfile, name, data_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5]
    mode = sys.argv[6] if len(sys.argv) > 6 else "tensor"
    leader = int(sys.argv[7]) if len(sys.argv) > 7 else 0  # the rank that serves (a replica's is its node's)
    leads = rank == leader
    os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), hostfile
    import mlx.core as mx
    from cluster.models.loading import load_model

    from cluster.config import CacheConfig
    from cluster.engine.cold_session import ColdSession
    from cluster.engine.sharding import geometry
    from cluster.engine.sharding import shard as split
    from cluster.actors.plan import FetchPlan
    from cluster.kvcache.admission import Admission
    from cluster.kvcache.peers import PeerClient
    from cluster.kvcache.store_link import LocalLink
    from cluster.store.disk_tier import DiskStore
    from cluster.kvcache.session import BlockSession
    from cluster.kvcache.setup import CacheSetup, setup_cache
    from cluster.kvcache.shard_restore import ShardRestore, cache_on_every_rank
    from cluster.engine.events import Delta, Finished, Started
    from cluster.engine.lockstep import Lockstep
    from cluster.engine.request import GenerationParams, SamplingParams
    from cluster.engine.schedule import Schedule
    from cluster.engine.sharded_scheduler import ShardedScheduler
    from cluster.engine.sequence import Sequence
    from cluster.models.resolve import resolve_model

    schedule = Schedule.of("chunk", 32, 64)
    scheduler = ShardedScheduler(name=f"mlx-fleet-rank{rank}", decode_concurrency=16)

    def setup():
        group = mx.distributed.init(backend="ring", strict=True)
        model, tok = load_model(resolve_model(name, data_dir))
        return group, model, tok

    group, model, tok = scheduler.run(setup)

    def seq(prompt, params, step=64) -> Sequence:
        return Sequence(prompt, params, model, tok, ColdSession(model, schedule=schedule), step)

    def greedy(n: int) -> GenerationParams:
        return GenerationParams(max_tokens=n, sampling=SamplingParams(logprobs=0))

    prompts = [prompt_of(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    result = {"rank": rank, "size": group.size()}
    if leads:  # the whole model's answers, each request alone
        def alone():
            answers = []
            for p in prompts:
                s = seq(p, greedy(GREEDY))
                s.begin()
                events = []
                while not s.done:
                    events += s.step()
                answers.append(events)
            return answers
        result["unsharded"] = [describe(e, Delta, Finished) for e in scheduler.run(alone)]

    def shard():
        split(model, group, mode)
        setup = setup_cache(model, tok, resolve_model(name, data_dir), CacheConfig(block_tokens=32, ram_bytes=1 << 30),
                            Path(out).parent / f"cache{rank}", prefill_step=64,
                            shard=geometry(mode, 2, rank))  # its probes are forwards: both ranks, here
        alone = cache_on_every_rank(setup if leads else CacheSetup(None, None, "off"), group)  # one rank without
        result["alone"] = alone.disabled_reason if alone.cache is None else "kept"
        peer_store = DiskStore(Path(out).parent / f"peer{rank}")
        own_every = setup.cache.every
        caches = [cache_on_every_rank(setup, group).cache]
        result["every"] = [own_every, caches[0].every]  # this rank's checkpoint interval, and the one agreed
        for d, link in [("peer", LocalLink(peer_store)), ("fresh", None)]:  # a peer replica's rank, a fresh one's
            caches.append(setup_cache(model, tok, resolve_model(name, data_dir), CacheConfig(block_tokens=32, ram_bytes=1 << 30),
                                      Path(out).parent / f"{d}{rank}", store_link=link, prefill_step=64,
                                      shard=geometry(mode, 2, rank)).cache)
        return caches, peer_store
    (pc, peer_pc, fresh_pc), peer_store = scheduler.run(shard)
    admission = Admission(pc)
    restore = ShardRestore(admission, group, ThreadPoolExecutor(2) if not leads else None)
    fresh = Admission(fresh_pc, peers=PeerClient(fresh_pc.namespace, local_stores={f"peer-r{rank}": peer_store}))
    restores = {id(pc): restore, id(peer_pc): ShardRestore(Admission(peer_pc), group, ThreadPoolExecutor(2)),
                id(fresh_pc): ShardRestore(fresh, group, ThreadPoolExecutor(2) if not leads else None)}
    order = [pc, pc, pc, peer_pc, fresh_pc]  # each cached run's cache, on both ranks
    generated: dict[str, list[int]] = {}
    told = []

    def read_ahead(prompt, pull=None):
        told.append(len(prompt))
        if len(told) == 3:  # the third cached run: this rank loses its blocks, so the ranks must agree on none
            for key in pc.tiers.ram.keys():
                pc.tiers.ram.discard(key)
        if len(told) == 5:  # the peer's blocks are on its disk by the time a route plan names it
            assert peer_pc.tiers.disk.flush(30)
        plan = FetchPlan.from_shared(pull).for_rank(rank, 2) if pull else None  # as a ShardRank's reader does
        restores[id(order[len(told) - 1])].read_ahead(prompt, plan)

    def rebuild(prompt, params, step, cached):
        c = order[len(told) - 1]
        s = Sequence(prompt, params, model, tok, BlockSession(c, prompt, None, restores[id(c)]), step) if cached \
            else seq(prompt, params, step)
        generated[str(len(generated))] = s.generated  # the same object: filled as the follower decodes
        return s

    scheduler.join(Lockstep(group, leader), rebuild, read_ahead)
    if leads:
        seqs = [seq(p, greedy(GREEDY)) for p in prompts]
        seqs.append(seq(prompts[3], GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=1.0))))
        cancel = seq(prompts[1], greedy(40))
        got = serve(scheduler, seqs, cancel, Started)
        result["sharded"] = [describe(e, Delta, Finished) for e in got]
        result["sampled"] = seqs[-1].generated
        result["cancelled_after"] = len(cancel.generated)
        result["generated"] = [cancel.generated] + [s.generated for s in seqs]  # in the order submitted
        cached = []
        # cold, restored, (the follower's blocks gone) cold on both ranks; the peer's run, and the fresh one's pull
        end = len(CACHED_PROMPT) // 32
        plan = FetchPlan("peer-r0", 0, end, fresh_pc.layout.has_recurrent, end * 32, end * fresh_pc.block_bytes,
                         ("peer-r0", "peer-r1"))
        for i, c in enumerate(order):
            params = GenerationParams(max_tokens=GREEDY, record_logits=True)
            pull = plan if c is fresh_pc else None
            scheduler.read_ahead(CACHED_PROMPT, pull.shared() if pull else None)  # as a replica's admission does
            if c is fresh_pc:
                assert peer_pc.tiers.disk.flush(30)
            prefetch = restores[id(c)].admission.fetch(CACHED_PROMPT, pull.for_rank(rank, 2) if pull else None)
            s = Sequence(CACHED_PROMPT, params, model, tok, BlockSession(c, CACHED_PROMPT, prefetch, restores[id(c)]),
                         64)
            [events] = scheduler.run_all([s], timeout_s=120)
            logits = scheduler.run(lambda: mx.stack(s.logits).astype(mx.float32).tolist())
            started = next(e for e in events if isinstance(e, Started))
            cached.append({"offered": prefetch.n, "cached_tokens": started.cached_tokens, "logits": logits,
                           "tokens": list(s.generated)})
            result["generated"].append(s.generated)
        result["cached"] = cached
        scheduler.stop()
    else:
        while scheduler.alive:  # until the leader stops: its last item stops this rank too
            time.sleep(0.05)
        result["generated"] = [generated[str(i)] for i in range(len(generated))]
    result["restore"] = restore.stats()
    result["pulled"] = {"restore": restores[id(fresh_pc)].stats(), "blocks": fresh.peers.counters["blocks"],
                        "checkpoint": fresh_pc.layout.has_recurrent}  # this rank's layers have recurrent ones
    Path(out).write_text(json.dumps(result))
    return 0


def serve(scheduler, seqs, cancel, started):
    """Every sequence at once, and one more cancelled once it has three tokens."""
    import threading

    from cluster.engine.events import TERMINAL, Delta

    done = threading.Event()
    events = [[] for _ in seqs]
    ended = [False] * len(seqs)
    lock = threading.Condition()

    def emit_for(i):
        def emit(batch):
            with lock:
                events[i].extend(batch)
                ended[i] = ended[i] or any(isinstance(e, TERMINAL) for e in batch)
                lock.notify_all()
        return emit

    cancel_tokens = []

    def emit_cancel(batch):
        with lock:
            cancel_tokens.extend(t for e in batch if isinstance(e, Delta) for t in e.token_ids)
            lock.notify_all()

    scheduler.submit("cancel-me", cancel, emit_cancel)
    for i, s in enumerate(seqs):
        scheduler.submit(f"r{i}", s, emit_for(i))
    with lock:
        lock.wait_for(lambda: len(cancel_tokens) >= 3, 120)
    scheduler.cancel("cancel-me")
    with lock:
        lock.wait_for(lambda: all(ended), 300)
    done.set()
    return events


def describe(events, delta, finished) -> dict:
    toks = [t for e in events if isinstance(e, delta) for t in e.token_ids]
    first = next((e.logprobs[0].logprob for e in events if isinstance(e, delta) and e.logprobs), None)
    end = next(e for e in events if isinstance(e, finished))
    return {"tokens": toks, "first_logprob": first, "finish": end.finish_reason}


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's ring backend aborts in its teardown at interpreter exit; everything is written by now
