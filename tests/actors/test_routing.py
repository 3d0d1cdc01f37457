"""The gateway's cost model and bounded load, on plain data."""

import heapq
import random
from collections import Counter
from dataclasses import replace

import msgpack
import pytest

from cluster.actors.fleet_view import ReplicaInfo
from cluster.actors.plan import RoutePlan
from cluster.actors.routing import choose, options, restorable
from cluster.config import RoutingConfig
from cluster.store.fleet_index import Holding

NS = b"n" * 32
CFG = RoutingConfig(default_prefill_tps=1000.0, default_link_bytes_per_s=100e6)


def node(i, **kw) -> ReplicaInfo:
    return ReplicaInfo(model="m", node_id=f"n{i}", node_name=f"n{i}", ray_node_id=f"ray{i}", healthy=True,
                       namespace=kw.pop("ns", NS), block_tokens=64, **kw)


def holding(i, hit=0, disk=0, ck=0, ck_disk=0, **lease) -> Holding:
    return Holding(f"n{i}", hit, hit, disk, ck, ck_disk, {"block_bytes": 262_144, **lease})


def plan_for(prompt_len, nodes, held, loads=None, factor=1.25) -> RoutePlan:
    random.seed(0)
    return choose(options(prompt_len, nodes, {h.node_id: h for h in held}, loads or {}, CFG), factor)


def test_the_holder_of_the_longest_prefix_wins_when_idle():
    plan = plan_for(2048, [node(0), node(1), node(2)], [holding(0, hit=8), holding(1, hit=30)])
    assert (plan.node_id, plan.reason, plan.tokens, plan.fetch) == ("n1", "hit", 1920, None)  # RAM only: nothing to pull
    assert plan.ranked[0] == "ray1"


def test_a_holder_plan_names_its_disk_prefix_for_a_replica_the_router_moves_it_to():
    plan = plan_for(2048, [node(0), node(1)], [holding(1, hit=30, disk=20)])
    assert (plan.node_id, plan.tokens) == ("n1", 1920)
    f = plan.fetch
    assert (f.peer, f.start_block, f.end_block, f.tokens, f.nbytes) == ("n1", 0, 20, 1280, 20 * 262_144)


def test_a_busy_holder_is_predicted_slower_than_a_peer_that_pulls_from_it():
    nodes = [node(0), node(1), node(2)]
    plan = plan_for(2048, nodes, [holding(1, hit=30, disk=30)], loads={"n1": 6})
    assert plan.node_id != "n1" and plan.reason == "hit"  # the fastest answer overall, with the prefix pulled
    assert plan.fetch is not None and (plan.fetch.peer, plan.fetch.start_block, plan.fetch.end_block) == ("n1", 0, 30)
    assert plan.tokens == 1920 and plan.fetch.nbytes == 30 * 262_144


def test_the_fastest_node_over_the_load_bound_is_skipped_with_reason_load():
    nodes = [node(0), node(1), node(2)]
    held = [holding(1, hit=30, disk=30, block_bytes=1 << 30)]  # pulling would take minutes
    plan = plan_for(2048, nodes, held, loads={"n1": 3})  # fastest, but 3 + 1 > ceil(1.25 x 4 / 3)
    assert plan.node_id != "n1" and plan.reason == "load" and plan.fetch is None
    assert plan.ranked[-1] == "ray1"  # still offered to the router, last


def test_pulling_is_chosen_only_when_it_beats_recomputing():
    slow_link = [holding(1, hit=30, disk=30)]
    nodes = [node(0), node(1)]
    fast = options(2048, nodes, {"n1": slow_link[0]}, {"n1": 5}, CFG)
    assert fast[0].fetch is not None  # 7.5 MiB at 100 MB/s beats 1920 tokens at 1000/s
    slow = options(2048, nodes, {"n1": holding(1, hit=30, disk=30, block_bytes=10 << 30)}, {"n1": 5}, CFG)
    assert slow[0].fetch is None  # 300 GiB would not


def test_only_what_a_peer_has_on_disk_can_be_pulled_and_only_within_a_namespace():
    nodes = [node(0), node(1), node(2, ns=b"o" * 32)]
    opts = {o.node.node_id: o for o in options(2048, nodes, {"n1": holding(1, hit=30, disk=10)}, {}, CFG)}
    assert opts["n0"].fetch.end_block == 10  # the RAM-only part of n1's prefix cannot be sent
    assert opts["n2"].fetch is None  # another fingerprint's blocks are no use to n2


def test_a_sharded_replica_pulls_rank_to_rank_only_from_one_of_the_same_geometry():
    """A's leader is rank 0 (n0, with n2), B's is rank 1 (n1, with n3): their leaders' namespaces differ, but every
    rank's agrees, so A pulls B's prefix, each rank from its counterpart's node. A replica that agrees on some
    ranks only, or an unsharded one, pulls nothing: its heads are other ones."""
    R0, R1 = b"0" * 32, b"1" * 32
    a = node(0, ns=R0, ranks=("n0", "n2"), rank_namespaces=(R0, R1))
    b = node(1, ns=R1, ranks=("n3", "n1"), rank_namespaces=(R0, R1))
    other = node(4, ns=R0, ranks=("n4", "n5"), rank_namespaces=(R0, b"x" * 32))
    whole = node(6, ns=R0)
    opts = {o.node.node_id: o for o in options(2048, [a, b, other, whole], {"n1": holding(1, hit=30, disk=30)},
                                               {"n1": 5}, CFG)}
    f = opts["n0"].fetch
    assert (f.peer, f.peer_ranks, f.end_block, opts["n0"].tokens) == ("n1", ("n3", "n1"), 30, 1920)
    assert [f.for_rank(r, 2).peer for r in (0, 1)] == ["n3", "n1"] and f.for_rank(1, 2).peer_ranks == ()
    # A plan Serve's router moved to a replica split otherwise pulls nothing there: no counterpart holds its heads
    assert f.for_rank(0, 1) is None and f.for_rank(0, 4) is None
    whole_plan = opts["n1"].holder.__class__("n9", 0, 30, False, 1920, 1)
    assert whole_plan.for_rank(0, 1) == whole_plan and whole_plan.for_rank(1, 2) is None
    assert type(f).from_shared(msgpack.unpackb(msgpack.packb(f.shared()))) == f  # as a leader tells its followers
    assert opts["n4"].fetch is None and opts["n6"].fetch is None
    assert opts["n1"].holder.peer_ranks == ("n3", "n1")  # a replica the router moves it to pulls the same way
    # A's leader measured the link its own rank pulls over (from B's rank-0 node, n3), not B's leader's
    slow = {"n1": holding(1, hit=30, disk=30), "n0": holding(0, link_bps={"n3": 1e3})}
    assert {o.node.node_id: o for o in options(2048, [a, b], slow, {"n1": 5}, CFG)}["n0"].fetch is None


def test_nobody_holding_anything_is_a_miss_that_goes_to_the_least_loaded():
    plan = plan_for(500, [node(0), node(1), node(2)], [], loads={"n0": 2, "n1": 0, "n2": 1})
    assert (plan.node_id, plan.reason) == ("n1", "miss")


def test_bounded_load_spreads_a_hot_prefix():
    nodes = [node(i) for i in range(3)]
    loads = {"n0": 0, "n1": 0, "n2": 0}
    held = {"n0": holding(0, hit=30, disk=30)}
    for _ in range(30):  # a burst on one hot system prompt
        plan = choose(options(2048, nodes, held, loads, CFG), 1.25)
        loads[plan.node_id] += 1
    assert max(loads.values()) / (sum(loads.values()) / 3) <= 1.25
    assert loads["n0"] == max(loads.values())  # affinity is never switched off: the holder fills first


@pytest.mark.parametrize("recurrent,boundary,blocks,ck,expected", [
    (False, False, 10, 0, 640), (False, False, 40, 0, 1999), (False, True, 40, 0, 1984),
    (True, False, 10, 7, 448), (True, False, 10, 0, 0)])
def test_restorable_follows_each_layout(recurrent, boundary, blocks, ck, expected):
    info = node(0, recurrent=recurrent, boundary_only=boundary)
    assert restorable(info, 2000, blocks, ck) == expected


def test_the_route_header_says_what_happened():
    plan = RoutePlan(policy="affinity", reason="hit", node_id="n1")
    assert plan.header("n1", 3072, 1024, "n2") == "affinity reason=hit local=3072 fetched=1024 from=n2"
    assert plan.header("n0", 0, 0, None) == "affinity reason=load local=0 fetched=0"  # the router moved it
    assert RoutePlan(policy="pow2", reason="policy").header("n0", 64, 0, None) == "pow2 reason=policy local=64 fetched=0"


def test_a_few_percent_of_measured_speed_never_moves_a_prefix_away_from_its_holder():
    nodes = [node(0), node(1)]
    held = {"n0": holding(0, hit=10, disk=10, prefill_tps=900.0), "n1": holding(1, prefill_tps=1100.0)}
    plan = choose(options(700, nodes, held, {}, CFG), 1.25)
    assert (plan.node_id, plan.fetch.peer) == ("n0", "n0")
    held["n2"] = holding(2)  # a node that has not measured yet counts as the mean, not as the optimistic default
    plan = choose(options(700, nodes + [node(2)], held, {}, CFG), 1.25)
    assert plan.node_id == "n0"


def test_a_really_faster_node_keeps_its_speed():
    nodes = [node(0), node(1)]
    held = {"n0": holding(0, hit=3, disk=3, prefill_tps=500.0), "n1": holding(1, prefill_tps=5000.0)}
    plan = choose(options(4000, nodes, held, {}, CFG), 1.25)
    assert plan.node_id == "n1"  # 5000 tokens/s is not noise


def test_a_holder_with_prompts_queued_waits_for_them_in_the_prediction():
    """A whole-prompt holder is not instant when this gateway has sent it 6,000 prompt tokens that are not
    prefilled yet (6 s at 1,000 tokens/s): a free node that pulls the prefix answers first. The lease's own
    queued_tokens (6,000 here too) is not what counts: it may be a flush old."""
    nodes = [node(0), node(1)]
    idle = plan_for(2048, nodes, [holding(1, hit=32, disk=32)])
    assert idle.node_id == "n1" and idle.predicted_ttft_s < 0.01
    random.seed(0)
    queued = choose(options(2048, nodes, {"n1": holding(1, hit=32, disk=32, queued_tokens=6000)}, {"n1": 1}, CFG,
                            queued={"n1": 6000}), 1.25)
    assert queued.node_id == "n0" and queued.reason == "hit" and queued.fetch.peer == "n1"
    assert queued.predicted_ttft_s == pytest.approx(1 / 1000 * 1 + 32 * 262_144 / 100e6, rel=1e-6)


def test_near_ties_go_to_the_node_sent_the_fewest_requests_lately():
    """A new conversation on a shared system prompt: its holder saves only the prompt's pull, a few
    milliseconds of a second of prefill, so a node used less lately takes it and pulls the prompt."""
    nodes = [node(0), node(1), node(2)]
    held = {"n0": holding(0, hit=5, disk=5)}  # the system prompt's 5 blocks, on n0's disk
    opts = options(1500, nodes, held, {}, CFG)
    random.seed(0)
    busy = choose(opts, 1.25, recent={"n0": 4.0, "n1": 2.0, "n2": 1.0}, near=(0.25, 0.05, 0.5), prompt_len=1500)
    assert (busy.node_id, busy.reason, busy.fetch.peer, busy.tokens) == ("n2", "load", "n0", 320)
    even = choose(opts, 1.25, recent={"n0": 1.0, "n1": 1.0, "n2": 1.0}, near=(0.25, 0.05, 0.5), prompt_len=1500)
    assert (even.node_id, even.reason) == ("n0", "hit")


def test_a_conversations_next_turn_stays_with_its_history_whatever_the_recent_load():
    nodes = [node(0), node(1), node(2)]
    held = {"n0": holding(0, hit=30, disk=30, block_bytes=4096)}  # 1920 tokens of history, cheap to pull
    plan = choose(options(2000, nodes, held, {}, CFG), 1.25, recent={"n0": 9.0}, near=(0.25, 1.0, 0.5),
                  prompt_len=2000)
    assert (plan.node_id, plan.reason, plan.tokens) == ("n0", "hit", 1920)


def test_a_stale_lease_queue_does_not_move_a_request_off_its_holder():
    nodes = [node(0), node(1)]
    held = {"n1": holding(1, hit=32, disk=32, queued_tokens=6000)}  # announced before its last prompt started
    plan = choose(options(2048, nodes, held, {}, CFG, queued={}), 1.25)
    assert (plan.node_id, plan.reason, plan.tokens) == ("n1", "hit", 2047)


def test_a_gateway_counts_its_own_requests_exactly_and_the_other_gateways_from_the_lease():
    from cluster.actors.routing import Affinity

    a, b = Affinity(None, None, CFG), Affinity(None, None, CFG)
    nodes = [node(0), node(1)]
    held = {"n0": holding(0, active=9, queued_tokens=900, by_origin={a.origin: [2, 400], b.origin: [7, 500]}),
            "n1": holding(1, active=3, queued_tokens=300, by_origin={a.origin: [3, 300]})}
    a.track("n0", 5)  # 2 of these were in the lease, 3 are newer than it
    a.track_queued("n0", 100)  # the lease's 400 have started since
    assert a.loads(nodes, held) == ({"n0": 7 + 5, "n1": 0}, {"n0": 500 + 100, "n1": 0})
    assert b.loads(nodes, held) == ({"n0": 2, "n1": 3}, {"n0": 400, "n1": 300})
    assert a.origin != b.origin
    odd = {"n0": holding(0, active=4, queued_tokens=50, by_origin={a.origin: "?"}),
           "n1": holding(1, active="x", by_origin=[1])}
    assert b.loads(nodes, odd) == ({"n0": 4, "n1": 0}, {"n0": 50, "n1": 0})  # a split it cannot read: all others'


def test_two_gateways_spread_a_burst_on_a_hot_prompt_with_leases_a_flush_behind():
    """30 requests at once on one hot system prompt, through two gateways (Serve's proxy picks one at random)
    that see each other's requests only in leases written every 10 requests. Each must count the other's requests on the holder as well as its own:
    taking the larger of the two put 16 of 30 on the holder."""
    from cluster.actors.routing import Affinity

    nodes = [node(i) for i in range(3)]
    gateways = [Affinity(None, None, CFG), Affinity(None, None, CFG)]
    on = {n.node_id: {g.origin: 0 for g in gateways} for n in nodes}  # what each replica runs, by gateway

    def leases():
        return {n.node_id: holding(int(n.node_id[1]), hit=7 if n.node_id == "n0" else 0,
                                   disk=7 if n.node_id == "n0" else 0, active=sum(on[n.node_id].values()),
                                   by_origin={o: [c, 0] for o, c in on[n.node_id].items()}) for n in nodes}

    held = leases()
    random.seed(0)
    proxy = random.Random(1)
    for i in range(30):
        g = proxy.choice(gateways)
        loads, queued = g.loads(nodes, held)
        plan = choose(options(480, nodes, held, loads, CFG, queued), 1.25, recent=g._recent(nodes),
                      near=(0.25, 0.05, 0.5), prompt_len=480)
        g._sent(plan.node_id)
        g.track(plan.node_id, 1)
        on[plan.node_id][g.origin] += 1
        if i % 10 == 9:
            held = leases()
    served = {n: sum(c.values()) for n, c in on.items()}
    assert max(served.values()) / 10 <= 1.5, served
    assert served["n0"] == max(served.values())  # the holder still fills first


def test_a_history_is_not_sent_away_for_a_prediction_a_few_percent_off():
    """The holder looks 0.3 s busy (a load figure a moment old); recomputing all 2048 tokens elsewhere is
    predicted 2.048 s against its 2.049 s. Within the margin, the node holding the history keeps it."""
    nodes = [node(0), node(1)]
    held = {"n1": holding(1, hit=32, disk=0)}  # in RAM only: nobody can pull it
    opts = options(2048, nodes, held, {}, CFG, queued={"n1": 2048})
    assert min(opts, key=lambda o: o.ttft_s).node.node_id == "n0"
    plan = choose(opts, 1.25, recent={}, near=(0.25, 0.05, 0.5), prompt_len=2048)
    assert (plan.node_id, plan.reason, plan.tokens) == ("n1", "hit", 2047)


NEAR = (CFG.near_ratio, CFG.near_s, CFG.near_share)


def test_equal_holders_of_a_hot_prompt_spread_by_the_requests_sent_them_lately():
    """Once the peers have pulled a hot system prompt, every node holds its 31 blocks: equals. The one this
    gateway sent the fewest requests lately takes the next conversation, not the first holder every time."""
    nodes = [node(i) for i in range(3)]
    held = {f"n{i}": holding(i, hit=31, disk=31) for i in range(3)}
    opts = options(2010, nodes, held, {}, CFG)
    random.seed(0)
    plan = choose(opts, 1.25, recent={"n0": 3.0, "n1": 1.0, "n2": 2.0}, near=NEAR, prompt_len=2010)
    assert (plan.node_id, plan.tokens, plan.fetch.peer) == ("n1", 1984, "n1")  # its own disk prefix, for the router
    served = Counter()
    recent = {}
    for _ in range(12):
        plan = choose(opts, 1.25, recent=recent, near=NEAR, prompt_len=2010)
        served[plan.node_id] += 1
        recent[plan.node_id] = recent.get(plan.node_id, 0.0) + 1
    assert served == {"n0": 4, "n1": 4, "n2": 4}


def test_holders_within_a_block_of_each_other_are_equals_and_two_blocks_more_is_a_history():
    """The first holder's copy may reach one block further (its RAM copy took the last block a pull did not):
    still equals. Two blocks more are the conversation's own history, and it keeps the request."""
    nodes = [node(i) for i in range(3)]
    for extra, expected in ((1, "n2"), (2, "n0")):
        held = {"n0": holding(0, hit=31 + extra, disk=31), "n1": holding(1, hit=31, disk=31),
                "n2": holding(2, hit=31, disk=31)}
        random.seed(0)
        plan = choose(options(2200, nodes, held, {}, CFG), 1.25, recent={"n0": 2.0, "n1": 1.0}, near=NEAR,
                      prompt_len=2200)
        assert plan.node_id == expected, extra


def test_a_copy_predicted_slower_inside_the_near_band_does_not_lose_every_tie():
    """Stated in predictions, not tiers: equal holders whose predicted TTFT is within the near band of the
    fastest (a copy read from disk, a few milliseconds slower) take their share by recent requests; one
    predicted slower than the band does not."""
    nodes = [node(i) for i in range(3)]
    held = {f"n{i}": holding(i, hit=31, disk=31) for i in range(3)}
    opts = options(2010, nodes, held, {}, CFG)
    for slower, expected in ((0.02, "n2"), (1.0, "n0")):
        shifted = [o if o.node.node_id == "n0" else replace(o, ttft_s=o.ttft_s + slower) for o in opts]
        random.seed(0)
        plan = choose(shifted, 1.25, recent={"n0": 2.0, "n1": 1.0}, near=NEAR, prompt_len=2010)
        assert plan.node_id == expected, slower


def replay_steady_clients(seed: int) -> Counter:
    """Issue 27's workload on plain data, in simulated time. A hot system prompt (31 blocks, warmed on n0);
    6 clients each send 4 requests one after another: the prompt and a new user message (2,010 tokens),
    8 tokens back. Two gateways (the proxy picks one at random) see each other's requests and the peers'
    copies only as the last flush (every 0.2 s) wrote them. Prefills run first come, first served at 1,000
    tokens/s; a pull takes its bytes at the link's speed; decode steps slow with the sequences beside them;
    all jittered."""
    from cluster.actors.routing import Affinity

    rng, now = random.Random(seed), [0.0]
    random.seed(seed)  # choose's tie-breaks
    nodes = [node(i) for i in range(3)]
    gateways = [Affinity(None, None, CFG), Affinity(None, None, CFG)]
    for g in gateways:
        g.clock = lambda: now[0]
    holds = {"n0": 31}  # blocks each node holds of the system prompt
    running = {n.node_id: {g.origin: [0, 0] for g in gateways} for n in nodes}  # [sequences, queued tokens]
    prefill_free = {n.node_id: 0.0 for n in nodes}

    def flush():
        return {n.node_id: holding(int(n.node_id[1]), hit=holds.get(n.node_id, 0), disk=holds.get(n.node_id, 0),
                                   active=sum(a for a, _ in running[n.node_id].values()),
                                   queued_tokens=sum(q for _, q in running[n.node_id].values()),
                                   by_origin={o: list(v) for o, v in running[n.node_id].items()}) for n in nodes}

    rng.choice(gateways)._sent("n0")  # the warm-up request
    held, served, seq = flush(), Counter(), 0
    events = [(2.0 + rng.uniform(0, 0.5), c, "send", (c, 0)) for c in range(6)] + [(2.2, 6, "flush", None)]
    heapq.heapify(events)
    while events:
        now[0], _, kind, data = heapq.heappop(events)
        seq += 1
        if kind == "flush":
            held = flush()
            if events:
                heapq.heappush(events, (now[0] + 0.2, seq, "flush", None))
        elif kind == "send":
            client, k = data
            g = rng.choice(gateways)
            loads, queued = g.loads(nodes, held)
            plan = choose(options(2010, nodes, held, loads, CFG, queued), CFG.load_factor,
                          recent=g._recent(nodes), near=NEAR, prompt_len=2010)
            g._sent(plan.node_id)
            n, uncached = plan.node_id, 2010 - plan.tokens
            served[n] += 1
            g.track(n, 1)
            g.track_queued(n, uncached)
            running[n][g.origin][0] += 1
            running[n][g.origin][1] += uncached
            pull = plan.fetch.nbytes / CFG.default_link_bytes_per_s if plan.fetch and plan.fetch.peer != n else 0.0
            beside = sum(a for a, _ in running[n].values()) - 1
            start = max(now[0] + pull * rng.uniform(0.8, 1.5), prefill_free[n])
            prefill_free[n] = first = start + uncached / 1000 * rng.uniform(0.8, 1.5)
            done = first + 8 * 0.015 * (1 + 0.5 * beside) * rng.uniform(0.8, 1.5)
            heapq.heappush(events, (first, seq, "first", (n, g, uncached)))
            heapq.heappush(events, (done, seq, "done", (n, g, client, k)))
        elif kind == "first":
            n, g, uncached = data
            g.track_queued(n, -uncached)
            running[n][g.origin][1] -= uncached
        else:
            n, g, client, k = data
            g.track(n, -1)
            running[n][g.origin][0] -= 1
            holds[n] = 31  # pulled (or held) and kept: in its RAM and on its disk
            if k < 3:
                heapq.heappush(events, (now[0] + rng.uniform(0.0, 0.1), seq, "send", (client, k + 1)))
    assert sum(served.values()) == 24
    return served


def max_over_mean(served: Counter) -> float:
    return max(served.get(f"n{i}", 0) for i in range(3)) / (sum(served.values()) / 3)


def test_steady_clients_on_a_hot_prompt_spread_over_the_peers_that_hold_it(monkeypatch):
    """1,000 seeded replays of 6 clients x 4 sequential requests: max/mean load <= 1.5 in every one (1.25 at
    worst when written). The negative control is the rule before: the close node holding the most itself,
    then the fastest, takes every request mostly cached. It sends the ties to one holder and breaks the goal
    in some of 200 runs."""
    from cluster.actors import routing

    worst = max((max_over_mean(replay_steady_clients(seed)), seed) for seed in range(1000))
    assert worst[0] <= 1.5, worst
    monkeypatch.setattr(routing, "_equals", lambda opts, close: [
        max(close, key=lambda o: (0 if o.fetch else o.tokens, o.tokens, -o.ttft_s))])
    before = [max_over_mean(replay_steady_clients(seed)) for seed in range(200)]
    assert max(before) > 1.5
