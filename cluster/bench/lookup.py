"""The gateway's routing decision against its 2 ms goal: index lookup, and hash + lookup + score, by prompt length.

    mlx-fleet bench lookup [--redis-url URL] [--nodes 10] [--blocks 100000] [--iterations 300] [--json out.json]

A Redis on loopback (its own, unless --redis-url) holds an index of `nodes`
nodes and `blocks` blocks in one namespace, as a fleet would: each node holds
a different share of every prompt's prefix (node i the first i/nodes of it)
plus unrelated blocks. For prompts of 1k to 32k tokens (B = 64) it times,
`iterations` times each:
- lookup: the index query alone (one EVALSHA: counted on the server, the
  round-trip count must not grow with length);
- route:  what the gateway does per request once tokens are known - hash the
  chain, look up, score every node, choose (routing.py).
It prints p50 / p99 in ms and the ratio of p99 to the 2 ms goal at 8k tokens.
"""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from cluster.actors.fleet_view import ReplicaInfo
from cluster.actors.routing import choose, options
from cluster.bench.common import parser, prompt_tokens, write_json
from cluster.config import RoutingConfig
from cluster.ports import free_port
from cluster.fleet.redis_server import find_redis_server
from cluster.store.fleet_index import FleetIndex
from cluster.store.hashing import chain_ids

B = 64
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
NS = bytes(range(32))


def own_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def fill(index: FleetIndex, nodes: int, blocks: int) -> None:
    """Every node holds a growing share of the benchmark prompts, plus its part of `blocks` unrelated blocks."""
    longest = chain_ids(NS, prompt_tokens(max(LENGTHS)), B)
    rng = random.Random(0)
    filler = blocks // nodes
    for i in range(nodes):
        held = longest[: len(longest) * (i + 1) // nodes]
        noise = [rng.randbytes(32) for _ in range(filler)]
        index.replace(NS, f"node-{i}", "ram", held[: len(held) // 2] + noise[: filler // 2], [])
        index.replace(NS, f"node-{i}", "disk", held + noise[filler // 2:], held[::8])
        index.renew(NS, f"node-{i}", {"prefill_tps": 2000.0 + i, "active": i % 3, "block_bytes": 14 << 20}, 600_000)


def quantiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e3, s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3


def measure(index: FleetIndex, nodes: int, iterations: int) -> list[dict]:
    cfg = RoutingConfig()
    infos = [ReplicaInfo("m", f"node-{i}", f"node-{i}", f"ray{i}", True, NS, B) for i in range(nodes)]
    rows = []
    for length in LENGTHS:
        prompt = prompt_tokens(length)
        ids = chain_ids(NS, prompt, B)
        index.lookup(NS, ids)  # the script is loaded
        evalsha = index.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        lookup, route = [], []
        for _ in range(iterations):
            t0 = time.perf_counter()
            index.lookup(NS, ids)
            lookup.append(time.perf_counter() - t0)
        for _ in range(iterations):
            t0 = time.perf_counter()
            chain = chain_ids(NS, prompt, B)[: -(-(length - 1) // B)]
            held = {h.node_id: h for h in index.lookup(NS, chain)}
            choose(options(length, infos, held, {}, cfg), cfg.load_factor)
            route.append(time.perf_counter() - t0)
        calls = index.client.info("commandstats")["cmdstat_evalsha"]["calls"] - evalsha
        (l50, l99), (r50, r99) = quantiles(lookup), quantiles(route)
        rows.append({"tokens": length, "blocks": len(ids), "lookup_ms_p50": l50, "lookup_ms_p99": l99,
                     "route_ms_p50": r50, "route_ms_p99": r99, "round_trips_per_lookup": calls / (2 * iterations)})
    return rows


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--redis-url", default=None, help="an existing Redis to use (default: start one on loopback)")
    p.add_argument("--nodes", type=int, default=10, help="nodes in the index")
    p.add_argument("--blocks", type=int, default=100_000, help="blocks in the index")
    p.add_argument("--iterations", type=int, default=300, help="timings per prompt length")
    a = p.parse_args(argv)
    proc = None
    with tempfile.TemporaryDirectory() as work:
        if a.redis_url is None:
            proc, url = own_redis(Path(work))
        else:
            url = a.redis_url
        try:
            index = FleetIndex(redis.Redis.from_url(url))
            index.client.flushdb() if proc is not None else None
            fill(index, a.nodes, a.blocks)
            rows = measure(index, a.nodes, a.iterations)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    print(f"index: {a.nodes} nodes, {a.blocks} blocks + the benchmark prompts; {a.iterations} runs per length; "
          f"pid {os.getpid()}")
    print(f"{'tokens':>7}{'lookup p50':>12}{'lookup p99':>12}{'route p50':>11}{'route p99':>11}{'round trips':>13}")
    for r in rows:
        print(f"{r['tokens']:>7}{r['lookup_ms_p50']:>10.3f}ms{r['lookup_ms_p99']:>10.3f}ms{r['route_ms_p50']:>9.3f}ms"
              f"{r['route_ms_p99']:>9.3f}ms{r['round_trips_per_lookup']:>13.2f}")
    at8k = next(r for r in rows if r["tokens"] == 8192)
    print(f"8k tokens: route p99 {at8k['route_ms_p99']:.3f} ms = {at8k['route_ms_p99'] / 2:.2f}x the 2 ms goal; "
          f"lookup p99 {at8k['lookup_ms_p99']:.3f} ms")
    write_json(a.json, "lookup", {"nodes": a.nodes, "blocks": a.blocks, "rows": rows})
    return 0
