"""`mlx-fleet status` as text: what each replica line says its numbers count."""

from cluster.fleet.status_text import render


def replica(**over) -> dict:
    r = {"model": "tiny-dense", "node_id": "node-0-1a2b3c4d", "active": 1, "requests": 7, "prompt_tokens": 400,
         "cached_tokens": 100, "completion_tokens": 56, "started": 1000.0, "renewed": 1185.0, "decoding": 2,
         "waiting": 1, "queued_tokens": 33, "streams": 3, "backend": "gpu:sm_90",
         "batching": {"batching": True, "decode_concurrency": 32, "prefill_concurrency": 8, "mean_batch": 1.5,
                      "batched_steps": 20},
         "cache": {"enabled": False, "reason": "off in config"}}
    return r | over


def status(*replicas: dict) -> dict:
    return {"endpoint": "http://127.0.0.1:8000", "redis": {"url": "redis://127.0.0.1:6390", "reachable": True},
            "nodes": [], "replicas": list(replicas), "models": []}


def test_a_replica_line_says_since_when_its_counters_count():
    lines = render(status(replica())).splitlines()
    i = lines.index("replicas:")
    assert lines[i + 1] == ("  tiny-dense           on node-0-1a2b3c4d        active=1   requests=7      tokens: prompt=400      "
                            "cached=100      reuse=25%   completion=56 backend=gpu:sm_90 (since it started 3m05s ago)")
    assert lines[i + 2] == ("      batching: up to 32 decoding, 8 prefilling, mean batch 1.5 over 20 steps; decoding 2, "
                            "waiting 1, 33 prompt tokens to prefill, 3 in flight")


def test_the_batching_line_says_how_a_deterministic_replica_keeps_batched_rows_solo_exact():
    on = replica(batching={**replica()["batching"], "deterministic": "invariant kernel, every step at 32 rows"})
    lines = render(status(on)).splitlines()
    assert lines[lines.index("replicas:") + 2].endswith(
        "3 in flight; deterministic: invariant kernel, every step at 32 rows")
    assert "deterministic" not in render(status(replica(batching={**replica()["batching"], "deterministic": "off"})))


def test_a_sharded_replica_names_every_rank_and_its_node():
    nodes = [{"node_id": "node-1-5e6f7a8b", "node_name": "b", "rank": 1}, {"node_id": "node-0-1a2b3c4d", "node_name": "a",
                                                                          "rank": 0}]
    lines = render(status(replica(shards={"size": 2, "mode": "tensor", "backend": "jaccl", "nodes": nodes}))).splitlines()
    assert lines[lines.index("replicas:") + 3] == \
        "      shards: 2 (tensor parallel, jaccl) over rank 1 node-1-5e6f7a8b (leads), rank 0 node-0-1a2b3c4d"
    assert "shards:" not in render(status(replica(shards=None)))


def test_a_followers_line_says_what_its_own_cache_holds_read_and_pulled():
    cache = {"enabled": True, "namespace": "3f2a9c1e", "block_tokens": 32, "blocks_stored": 9, "checkpoints_stored": 0,
             "ram": {"blocks": 9, "bytes": 3 << 20, "budget": 1 << 30, "hits": 12, "misses": 2, "evictions": 0},
             "spill": {"queued": 0, "spilled": 9, "dropped_spills": 0},
             "shard_restore": {"agreed": 4, "cut_short": 0, "dropped": 0, "reads": 4, "late_reads": 1},
             "migration": {"fetches": 1, "blocks": 6, "bytes": 1 << 20, "failures": 0, "seconds": 0.01}}
    nodes = [{"node_id": "node-0-1a2b3c4d", "node_name": "a", "rank": 0},
             {"node_id": "node-1-5e6f7a8b", "node_name": "b", "rank": 1, "cache": cache}]
    lines = render(status(replica(shards={"size": 2, "mode": "tensor", "backend": "ring", "nodes": nodes}))).splitlines()
    assert lines[lines.index("replicas:") + 4] == (
        "      rank 1 cache 3f2a9c1e, 32-token blocks: ram 9 blocks 3.0/1024 MiB, served 12 blocks, 2 not in RAM, "
        "evictions 0, stored 9 blocks 0 checkpoints, corrupt 0, spill queued 0 spilled 9 dropped 0, its reads 4 "
        "(1 late), pulled 6 blocks (0 failed)")
    unread = [{**n, "cache": None} for n in nodes]  # not read yet (the first period), or a follower without one
    assert "rank 1 cache" not in render(status(replica(shards={"size": 2, "mode": "tensor", "nodes": unread})))


def test_replica_ages_read_in_seconds_minutes_or_hours():
    lines = [render(status(replica(renewed=1000.0 + s))).splitlines() for s in (42, 3600 * 2 + 420)]
    ages = [ls[ls.index("replicas:") + 1].rsplit("(", 1)[1] for ls in lines]
    assert ages == ["since it started 42s ago)", "since it started 2h07m ago)"]
    assert "(since it started - ago)" in render(status(replica(started=None)))
    assert "backend=- (since" in render(status(replica(backend=None)))  # a replica of an older version


def test_tier_lines_say_what_their_counters_count():
    """`served` counts blocks read from the tier; a block of a cached prefix not found there is `not in RAM`
    (read from the disk instead) or `not on disk` (gone: the prefix is shorter)."""
    cache = {"enabled": True, "namespace": "ab12cd34", "block_tokens": 64, "blocks_stored": 9, "checkpoints_stored": 0,
             "ram": {"blocks": 9, "bytes": 3 << 20, "budget": 2 << 30, "hits": 12, "misses": 2, "evictions": 0},
             "spill": {"queued": 0, "spilled": 9, "dropped_spills": 0}}
    disk = {"blocks": 9, "bytes": 3 << 20, "budget": 4 << 30, "hits": 2, "misses": 1, "evictions": 0,
            "dropped_spills": 0}
    st = status(replica(cache=cache)) | {
        "nodes": [{"name": "node-0", "node_id": "node-0-1a2b3c4d", "alive": True, "address": "127.0.0.1",
                   "metrics_port": 8080, "disk": disk}],
        "fleet": {"reuse": 0.25, "routes": {"affinity": 7}, "index_entries": {"ab12cd34": {"node-0-1a2b3c4d": 18}}}}
    lines = render(st).splitlines()
    assert lines[lines.index("nodes:") + 1] == ("  node-0     node-0-1a2b3c4d        alive  127.0.0.1  "
                                                "metrics http://127.0.0.1:8080/metrics")
    assert lines[lines.index("nodes:") + 2] == ("      disk: 9 blocks 3.0 MiB of 4.0 GiB, served 2 blocks, 1 not on disk, "
                                                "evictions 0, quarantined 0, dropped spills 0")
    assert lines[lines.index("replicas:") + 3] == (
        "      cache ab12cd34, 64-token blocks: ram 9 blocks 3.0/2048 MiB, served 12 blocks, 2 not in RAM, evictions 0, "
        "stored 9 blocks 0 checkpoints, corrupt 0, spill queued 0 spilled 9 dropped 0")
    assert lines[lines.index("replicas:") + 4] == (
        "      ram holds -, tails stored 0 hit 0, chose restore 0 recompute 0 (prefill 0 tok/s, ram 0 GB/s, disk 0 GB/s, "
        "to the device 0 GB/s, spill writes 0 GB/s)")
    assert "index 18 entries (a block or checkpoint once per node and tier holding it)" in lines[lines.index("fleet:") + 2]


def test_the_hot_path_line_says_what_ram_holds_and_what_was_chosen():
    cache = {"enabled": True, "namespace": "ab12cd34", "block_tokens": 64, "blocks_stored": 9, "checkpoints_stored": 0,
             "tails_stored": 3, "tail_hits": 2,
             "ram": {"blocks": 9, "bytes": 3 << 20, "budget": 2 << 30, "hits": 12, "misses": 2, "evictions": 0,
                     "holds": "device arrays"},
             "costs": {"prefill_tps": 23000.5, "ram_gbps": 810.2, "disk_gbps": 2.1, "move_gbps": 1.4, "write_gbps": 0.9,
                       "choices": {"restore": 5, "recompute": 1}},
             "spill_backlog": {"blocks": 4, "bytes": 6 << 20}}
    lines = render(status(replica(cache=cache))).splitlines()
    assert lines[lines.index("replicas:") + 4] == (
        "      ram holds device arrays, tails stored 3 hit 2, chose restore 5 recompute 1 (prefill 23000.5 tok/s, "
        "ram 810.2 GB/s, disk 2.1 GB/s, to the device 1.4 GB/s, spill writes 0.9 GB/s), spill backlog 4 blocks 6.0 MiB")


def test_a_broken_replica_says_why_it_serves_no_more():
    why = "rank 1 of this sharded replica (node node-1-5e6f7a8b) was lost (ActorDiedError); it is being replaced"
    lines = render(status(replica(broken=why))).splitlines()
    assert lines[lines.index("replicas:") + 3] == f"      BROKEN: {why}"
    assert "BROKEN" not in render(status(replica(broken=None)))
