"""Cache-affinity routing: send each request to the replica predicted to answer first.

For every node with a replica of the model, from one index lookup:

    predicted TTFT = prompt tokens queued there / its prefill tokens/s          (queue wait)
                   + (uncached tokens / its prefill tokens/s) x (1 + its load)
                   + (bytes to pull from a peer / that link's bytes/s)         if pulling pays

where the prefix it can restore is what it holds itself (RAM or disk), or
what the best live peer holds on disk and it would pull first. A new prompt
waits for prompt tokens already queued on a replica: without that term a
holder of the whole prompt would look instant however long its queue. The
term is the most it waits: the replica gives half its prefill rounds to the
prompts with the fewest tokens left (engine/scheduler.py), so a prompt with
few uncached tokens can start sooner; the lease does not say how the queue's
tokens split into prompts, so the bound stands. The queue counted is the
other gateways' share of the replica's lease's `queued_tokens` (a flush old)
plus this gateway's own requests sent there whose first token has not come yet
(their uncached tokens: exact and immediate). The lease splits its counts by
gateway, so each gateway replaces its own share with what it knows: a stale
lease showing the queue a request of ours just left would send the next turn
of a conversation away from its history to be recomputed.
Load counts sequences the same way: the other gateways' on the replica (its
lease) plus this gateway's own requests in flight to it. Taking the larger of
the lease and our own count instead lost the other gateway's requests whenever
ours were more: two gateways each filled a hot prompt's holder to the bound
(16 of 30 requests on one of 3 nodes).
Prefill chunks run between the batch's decode steps, so each sequence on it
slows a new prefill: hence the (1 + load). That is conservative for sequences
that are only decoding, which batching makes cheap.

Bounded load, so affinity degrades smoothly instead of switching off: with
total load T over N nodes, a node takes a request only while its load + 1 is
at most ceil(`load_factor` x (T + 1) / N). Among those nodes the fastest predicted
answer wins, so a hot system prompt fills its holder up to the bound and then
spreads - with the others pulling the prefix from it rather than recomputing.

Near ties spread: for a request of which the fastest node restores at most
`near_share` of the prompt (a new conversation on a shared system prompt), nodes
under the bound predicted within `near_ratio` x the fastest + `near_s` count as
equally fast, and the one this gateway sent the fewest requests lately (decayed,
`recent_half_life_s`) wins. The bound only sees sequences running now, so under
a light load it never binds; without this, every conversation sharing a system
prompt would go to the prompt's first holder when the others could pull it for
a few milliseconds. A conversation's next turn, most of which its node holds,
stays with it, and so conversations spread by their first turns. For a prompt
mostly cached, the close nodes holding the same prefix (within a block of each
other) are equals and spread the same way: a hot prompt the peers have pulled
is nobody's history, while a conversation's own blocks beyond the others' keep
it home (`choose`, `_equals`).

Reasons (x-fleet-route): `hit` (the fastest node overall, holding a prefix),
`load` (the fastest was over the bound or a near tie went to a less used node, or the
router moved the request: then the
replica that gets it pulls what the planned node holds on disk, as the plan's fetch
names that node; the planned node itself ignores a fetch from itself),
`miss` (nobody holds anything: least loaded), `fallback` (no index: power of
two choices), `policy` (pow2 / round_robin configured).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional

from cluster import metrics
from cluster.actors.fleet_view import FleetView, ReplicaInfo
from cluster.actors.plan import FetchPlan, RoutePlan
from cluster.config import RoutingConfig
from cluster.store.fleet_index import FleetIndex, Holding
from cluster.store.hashing import chain_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Option:
    """One way a node could serve the request."""

    node: ReplicaInfo
    tokens: int  # restorable
    ttft_s: float
    load: int
    fetch: Optional[FetchPlan] = None
    # What it holds on its own disk, as a pull from it: if the router moves the request elsewhere
    # (its replica looked too busy), the replica that gets it pulls this instead of recomputing.
    holder: Optional[FetchPlan] = None


def restorable(info: ReplicaInfo, prompt_len: int, blocks: int, checkpoint: int) -> int:
    """Tokens a node can restore holding `blocks` leading blocks and a checkpoint at block `checkpoint`."""
    B = info.block_tokens
    if info.recurrent:
        return checkpoint * B
    n = min(blocks * B, prompt_len - 1)
    n = n - n % B if info.boundary_only else max(n, 0)
    return n - n % info.resume_every


def prefill_speeds(nodes: list[ReplicaInfo], held: dict[str, Holding], default: float) -> dict[str, float]:
    """Each node's prefill tokens/s for the cost model.

    Measured speeds are noisy (they share machines, chunk sizes vary), and a
    few percent must not move a conversation away from the node that holds it.
    So speeds within 25% of the model's mean count as the mean; only a node
    really faster or slower (a Studio beside a mini) keeps its own. A node that
    has not measured yet counts as the mean too."""
    measured = {n.node_id: held[n.node_id].lease.get("prefill_tps") for n in nodes
                if n.node_id in held and held[n.node_id].lease.get("prefill_tps")}
    mean = sum(measured.values()) / len(measured) if measured else default
    return {n.node_id: measured[n.node_id] if n.node_id in measured and abs(measured[n.node_id] - mean) > 0.25 * mean
            else mean for n in nodes}


def options(prompt_len: int, nodes: list[ReplicaInfo], held: dict[str, Holding], loads: dict[str, int],
            cfg: RoutingConfig, queued: Optional[dict[str, int]] = None) -> list[Option]:
    """Every candidate node's best way to answer, with its predicted TTFT."""
    out = []
    info = {n.node_id: n for n in nodes}
    speeds = prefill_speeds(nodes, held, cfg.default_prefill_tps)
    for node in nodes:
        h = held.get(node.node_id)
        lease = h.lease if h else {}
        tps = speeds[node.node_id]
        load = loads.get(node.node_id, 0)
        wait = (queued or {}).get(node.node_id, 0) / tps
        local = restorable(node, prompt_len, h.hit, h.ck) if h else 0
        best = Option(node, local, wait + (prompt_len - local) / tps * (1 + load), load, None,
                      _holder(node, prompt_len, h))
        for peer_id, p in held.items():
            peer = info.get(peer_id)
            if peer_id == node.node_id or peer is None or peer.geometry != node.geometry:
                continue  # itself, or a node whose blocks are another fingerprint's (another GPU, another split)
            peer_tokens = restorable(node, prompt_len, p.disk, p.ck_disk)
            if peer_tokens <= local:
                continue
            start, end = local // node.block_tokens, -(-peer_tokens // node.block_tokens)
            nbytes = (end - start) * int(p.lease.get("block_bytes") or 0) + (
                int(p.lease.get("state_bytes") or 0) if node.recurrent else 0)
            links = lease.get("link_bps") or {}  # a sharded replica's leader measured its own counterpart's link
            link = links.get(peer_id) or next((links[n] for n in peer.ranks if links.get(n)), None) \
                or cfg.default_link_bytes_per_s
            ttft = wait + (prompt_len - peer_tokens) / tps * (1 + load) + nbytes / link
            if ttft < best.ttft_s:
                best = Option(node, peer_tokens, ttft, load,
                              FetchPlan(peer_id, start, end, node.recurrent, peer_tokens, nbytes, peer.ranks))
        out.append(best)
    return out


def _holder(node: ReplicaInfo, prompt_len: int, h: Optional[Holding]) -> Optional[FetchPlan]:
    """The node's own disk prefix as a pull from it (see Option.holder)."""
    tokens = restorable(node, prompt_len, h.disk, h.ck_disk) if h else 0
    if not tokens:
        return None
    end = -(-tokens // node.block_tokens)
    nbytes = end * int(h.lease.get("block_bytes") or 0) + (int(h.lease.get("state_bytes") or 0) if node.recurrent else 0)
    return FetchPlan(node.node_id, 0, end, node.recurrent, tokens, nbytes, node.ranks)


def choose(opts: list[Option], load_factor: float, policy: str = "affinity", recent: Optional[dict] = None,
           near: tuple[float, float, float] = (0.0, 0.0, 0.0), prompt_len: int = 0) -> RoutePlan:
    """Bounded load, then the fastest predicted answer; ranked fallbacks for the router.

    `recent` (node id -> requests sent there lately) and `near` (ratio, seconds, share): the nodes under
    the bound predicted within `ratio` x the fastest + `seconds` are close. The equals among them are:
    - all of them, if none restores more than `share` of the `prompt_len` tokens (a new conversation on a
      shared system prompt: its holder saves the others only a pull);
    - else those that hold the most of the prompt, within a block of each other (`holders`). A conversation's
      own history, blocks beyond what the other close nodes hold, keeps it on its node: a prediction a few
      percent off (a load figure a moment old) must not send it away to be pulled or recomputed. A hot
      prompt that every close node holds is nobody's history.
    Of the equals, the one sent the fewest requests lately wins, then the fastest. Without it a light load
    (where the instantaneous bound never binds) sends every conversation on a shared system prompt to one
    node: its first holder, and once the peers hold it too, whichever is predicted faster by a hair (a
    RAM copy against a disk one, a load figure a moment old)."""
    total = sum(o.load for o in opts)
    cap = math.ceil(load_factor * (total + 1) / len(opts))
    eligible = [o for o in opts if o.load + 1 <= cap] or opts
    ties = {id(o): random.random() for o in opts}  # equal predictions: spread, not always the first node

    def key(o: Option) -> tuple:
        return round(o.ttft_s, 6), o.load, ties[id(o)]

    fastest = min(opts, key=key)
    chosen = min(eligible, key=key)
    moved = chosen is not fastest  # by the load bound
    if recent is not None:
        bound = chosen.ttft_s * (1 + near[0]) + near[1]
        close = [o for o in eligible if o.ttft_s <= bound]
        equals = close if max(o.tokens for o in close) <= near[2] * prompt_len else _equals(opts, close)
        first = min(equals, key=key)  # the winner without the recent requests
        chosen = min(equals, key=lambda o: (round(recent.get(o.node.node_id, 0.0), 3), key(o)))
        moved = moved or chosen is not first
    if not any(o.tokens for o in opts):
        reason = "miss"
    else:
        reason = "load" if moved else "hit"
    ranked = [chosen] + sorted((o for o in eligible if o is not chosen), key=key) + \
        sorted((o for o in opts if o not in eligible), key=key)
    return RoutePlan(policy=policy, reason=reason, node_id=chosen.node.node_id,
                     ranked=tuple(o.node.ray_node_id for o in ranked), tokens=chosen.tokens,
                     fetch=chosen.fetch or chosen.holder,
                     predicted_ttft_s=chosen.ttft_s)


def _equals(opts: list[Option], close: list[Option]) -> list[Option]:
    """Of the close options to a prompt mostly cached, those that are equals: holding the most of it, within
    a block of each other.

    - Held alike (within a block) by two nodes or more, close or not, the prefix is nobody's own history (a
      hot system prompt the peers have pulled): every close node restoring as much, held or pulled, is an
      equal (its prediction, the pull included, is in the band). Counting only the close holders would make
      one holder's copy a history whenever the other holder is over the load bound.
    - Else the node holding the most itself has blocks beyond what the others hold, its conversation's
      history, and the equals are the close nodes holding as much themselves: that one alone, normally.
    - If no close node holds any of it itself, the nodes that would pull the most."""
    B = close[0].node.block_tokens
    held = sorted((o.tokens for o in opts if o.fetch is None), reverse=True) + [0, 0]
    if held[0] and held[1] >= held[0] - B:
        alike = [o for o in close if o.tokens >= held[0] - B]
        if alike:
            return alike
    top = max(close, key=lambda o: (0 if o.fetch else o.tokens, o.tokens))
    return [o for o in close if (o.fetch is None) == (top.fetch is None) and o.tokens >= top.tokens - B]


class Affinity:
    """The gateway's router: one index lookup per request (per namespace), then `choose`."""

    def __init__(self, index: Optional[FleetIndex], view: FleetView, cfg: RoutingConfig):
        self.index = index
        self.view = view
        self.cfg = cfg
        self.inflight: Counter = Counter()  # node id -> this gateway's requests running there
        self.queued: Counter = Counter()  # node id -> uncached prompt tokens of its requests not started there
        self.origin = uuid.uuid4().hex[:12]  # this gateway, as the replicas' leases name it (by_origin)
        self.reasons: Counter = Counter()
        self.lookup_s: deque = deque(maxlen=2000)
        self.recent: dict[str, tuple[float, float]] = {}  # node id -> (decayed requests sent, as of when)
        self.clock = time.monotonic  # of that decay (a replay in simulated time sets its own)

    def track(self, node_id: str, delta: int) -> None:
        self.inflight[node_id] += delta
        if self.inflight[node_id] <= 0:
            del self.inflight[node_id]

    def track_queued(self, node_id: str, tokens: int) -> None:
        """Prompt tokens this gateway sent to `node_id` that are not prefilled yet (+ when sent, - at start)."""
        self.queued[node_id] += tokens
        if self.queued[node_id] <= 0:
            del self.queued[node_id]

    def others(self, lease: dict) -> tuple[int, int]:
        """The other gateways' sequences and queued prompt tokens on a node, from its lease (a lease
        without a usable split, from an older replica say, counts as all the other gateways')."""
        try:
            active, tokens = int(lease.get("active") or 0), int(lease.get("queued_tokens") or 0)
        except (TypeError, ValueError):
            return 0, 0
        try:
            mine = lease["by_origin"][self.origin]
            mine_active, mine_tokens = int(mine[0]), int(mine[1])
        except (KeyError, IndexError, TypeError, ValueError):
            mine_active = mine_tokens = 0
        return max(0, active - mine_active), max(0, tokens - mine_tokens)

    def loads(self, nodes: list[ReplicaInfo], held: dict[str, Holding]) -> tuple[dict[str, int], dict[str, int]]:
        """Each node's sequences and queued prompt tokens: the other gateways' from its lease, ours exact."""
        loads, queued = {}, {}
        for r in nodes:
            active, tokens = self.others(held[r.node_id].lease if r.node_id in held else {})
            loads[r.node_id] = active + self.inflight[r.node_id]
            queued[r.node_id] = tokens + self.queued[r.node_id]
        return loads, queued

    async def plan(self, model: str, prompt: list[int]) -> RoutePlan:
        if self.cfg.policy != "affinity":
            return self.count(RoutePlan(policy=self.cfg.policy, reason="policy"))
        await self.view.ensure(self.cfg.lookup_timeout_s)
        nodes = [r for r in self.view.of(model) if r.healthy and r.namespace is not None]
        if self.index is None or not self.view.ok or not nodes:
            return self.count(RoutePlan(policy="affinity", reason="fallback"))
        try:
            held = await asyncio.wait_for(self._lookup(nodes, prompt), self.cfg.lookup_timeout_s)
        except Exception as e:  # Redis slow or away: keep serving, by power of two choices
            log.debug("index lookup failed (%s); falling back", type(e).__name__)
            metrics.inc("mlx_fleet_redis_errors", node="", component="index_lookup")
            return self.count(RoutePlan(policy="affinity", reason="fallback"))
        loads, queued = self.loads(nodes, held)
        plan = choose(options(len(prompt), nodes, held, loads, self.cfg, queued), self.cfg.load_factor,
                      recent=self._recent(nodes), near=(self.cfg.near_ratio, self.cfg.near_s, self.cfg.near_share),
                      prompt_len=len(prompt))
        self._sent(plan.node_id)
        return self.count(plan)

    def _recent(self, nodes: list[ReplicaInfo]) -> dict[str, float]:
        """Requests this gateway sent to each node lately, decayed with `recent_half_life_s`."""
        now = self.clock()
        decay = math.log(2) / self.cfg.recent_half_life_s
        out = {}
        for r in nodes:
            value, at = self.recent.get(r.node_id, (0.0, now))
            out[r.node_id] = value * math.exp(-decay * (now - at))
            self.recent[r.node_id] = (out[r.node_id], now)
        return out

    def _sent(self, node_id: Optional[str]) -> None:
        if node_id is not None:
            value, at = self.recent.get(node_id, (0.0, self.clock()))
            self.recent[node_id] = (value + 1.0, at)

    async def _lookup(self, nodes: list[ReplicaInfo], prompt: list[int]) -> dict[str, Holding]:
        """Holdings of every live node, one round trip per namespace (normally one)."""
        t0 = time.perf_counter()
        by_ns: dict[bytes, ReplicaInfo] = {r.namespace: r for r in nodes}
        calls = []
        for ns, r in by_ns.items():
            ids = chain_ids(ns, prompt, r.block_tokens)[: -(-(len(prompt) - 1) // r.block_tokens)]
            calls.append(self.index.alookup(ns, ids, (len(prompt) - 1) // r.block_tokens if r.recurrent else 0))
        results = await asyncio.gather(*calls)
        self.lookup_s.append(time.perf_counter() - t0)
        metrics.observe("mlx_fleet_index_lookup_seconds", self.lookup_s[-1], model=nodes[0].model)
        wanted = {(r.namespace, r.node_id) for r in nodes}
        return {h.node_id: h for ns, holdings in zip(by_ns, results) for h in holdings if (ns, h.node_id) in wanted}

    def count(self, plan: RoutePlan) -> RoutePlan:
        """Count a plan by its reason (status's routes), made here or, for a bypass, by the dispatcher."""
        self.reasons[plan.reason] += 1
        return plan

    def stats(self) -> dict:
        samples = sorted(self.lookup_s)

        def q(p):
            return round(samples[min(len(samples) - 1, int(p * len(samples)))] * 1000, 3) if samples else None

        return {"policy": self.cfg.policy, "reasons": dict(self.reasons), "inflight": dict(self.inflight),
                "lookups": len(samples), "lookup_ms_p50": q(0.5), "lookup_ms_p99": q(0.99)}
