"""Pulling a prefix from a peer against recomputing it, through a real 2-node fleet, in one run.

    mlx-fleet bench migrate [--tokens 2048] [--concurrency 4] [--model tiny-dense] [--kv-codec native [tq4 ...]]
                            [--shards N] [--json out.json]

1. One prompt of `tokens` token ids is computed cold on some node (the holder).
2. `concurrency` fresh prompts of the same length are sent at once: every one
   is computed cold somewhere. Their time to first token is the baseline.
3. `concurrency` copies of the first prompt are sent at once: bounded load
   spreads them, so the other node pulls the prefix from the holder (Ray, the
   node stores) instead of recomputing it. Their TTFT is compared with (2),
   under the same concurrency.
It prints both, their ratio, how many tokens were pulled, and the cost model's
inputs from `status` (each node's prefill tokens/s, each link's bytes/s).

`--shards N`: two replicas of N nodes each (2N nodes), so a pull goes rank to
rank, each of the puller's nodes reading its own heads' blocks from its
counterpart (docs/sharding.md); the followers' pulls are counted from status.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cluster.bench.common import parser, prompt_tokens, write_json
from cluster.fleet.spawned import SpawnedFleet


def first_token(http: httpx.Client, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        route = r.headers["x-fleet-route"]
        node = r.headers["x-fleet-node"]
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break
    pairs = dict(p.split("=", 1) for p in route.split()[1:])
    return {"ttft_s": time.monotonic() - t0, "node": node, "route": route, "fetched": int(pairs.get("fetched", 0)),
            "local": int(pairs.get("local", 0))}


def burst(http: httpx.Client, model: str, prompts: list[list[int]]) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: first_token(http, model, p), prompts))


def run(a, codec: str) -> dict:
    """The whole measurement on a fresh 2-node fleet whose blocks use `codec`."""
    shards = ("--shards", str(a.shards)) if a.shards > 1 else ()
    with tempfile.TemporaryDirectory(prefix="bench-migrate-") as work:
        with SpawnedFleet(Path(work) / "fleet", 2 * a.shards, (a.model,), extra=("--kv-codec", codec, *shards)) as fleet:
            with httpx.Client(base_url=fleet.url, timeout=600, trust_env=False) as http:
                shared = prompt_tokens(a.tokens, salt=1)
                holder = first_token(http, a.model, shared)
                time.sleep(3)  # on the holder's disk, announced in the index
                cold = burst(http, a.model, [prompt_tokens(a.tokens, salt=100 + i) for i in range(a.concurrency)])
                warm = burst(http, a.model, [shared] * a.concurrency)
            status = fleet.status()
            deadline = time.monotonic() + 15  # replicas publish their counters every few seconds
            while any(w["fetched"] for w in warm) and not status["fleet"]["migrated_bytes"] \
                    and time.monotonic() < deadline:
                time.sleep(1)
                status = fleet.status()
            followers = _follower_pulls(fleet, a.model, bool(any(w["fetched"] for w in warm))) if shards else []
    pulled = [w for w in warm if w["fetched"]]
    local = [w for w in warm if not w["fetched"]]
    cold_p50 = statistics.median(c["ttft_s"] for c in cold)
    row = {"tokens": a.tokens, "concurrency": a.concurrency, "kv_codec": codec, "holder": holder,
           "cold_ttft_s": [c["ttft_s"] for c in cold], "pulled_ttft_s": [w["ttft_s"] for w in pulled],
           "local_ttft_s": [w["ttft_s"] for w in local], "pulled_tokens": [w["fetched"] for w in pulled],
           "routes": [w["route"] for w in warm], "cost_model": status["fleet"]["cost_model"],
           "migrated_bytes": status["fleet"]["migrated_bytes"], "shards": a.shards, "follower_pulls": followers}
    print(f"{a.tokens}-token prompt, 2 replicas of {a.shards} node(s), {a.concurrency} requests at once, "
          f"--kv-codec {codec}:")
    print(f"  (alone, cold on the holder: TTFT {holder['ttft_s']:.3f}s)")
    print(f"  cold (recomputed)      TTFT p50 {cold_p50:.3f}s  {['%.2f' % c['ttft_s'] for c in cold]}")
    if pulled:
        pull_p50 = statistics.median(w["ttft_s"] for w in pulled)
        row["pulled_ttft_p50_s"] = pull_p50
        row["pulled_vs_cold"] = pull_p50 / cold_p50
        row["pulled_vs_cold_alone"] = pull_p50 / holder["ttft_s"]
        print(f"  pulled from the holder TTFT p50 {pull_p50:.3f}s  ({len(pulled)} requests, "
              f"{pulled[0]['fetched']} tokens each, {row['migrated_bytes'] / 1e6:.1f} MB moved in all): "
              f"{row['pulled_vs_cold']:.3f}x cold at the same concurrency, "
              f"{row['pulled_vs_cold_alone']:.3f}x cold alone")
    else:
        print("  no request was sent to the other node (every copy fit on the holder)")
    if local:
        print(f"  on the holder           TTFT p50 {statistics.median(w['ttft_s'] for w in local):.3f}s "
              f"({len(local)} requests)")
    for f in followers:
        print(f"  follower rank {f['rank']} of {f['leader']}: pulled {f['blocks']} blocks {f['bytes'] / 1e6:.1f} MB "
              f"({f['failures']} failed), its reads {f['reads']} ({f['late_reads']} late)")
    for node, cm in status["fleet"]["cost_model"].items():
        links = ", ".join(f"from {k}: {v / 1e6:.0f} MB/s" for k, v in cm["link_bytes_per_s"].items()) or "-"
        print(f"  {node}: prefill {cm['prefill_tps']:.0f} tokens/s; links {links}")
    return row


def _follower_pulls(fleet, model: str, expect: bool) -> list[dict]:
    """Each follower's pulls and reads, from status (its leader reads them every few seconds)."""
    deadline = time.monotonic() + 20
    while True:
        out = []
        for r in fleet.status()["replicas"]:
            if r["model"] != model or not r.get("shards"):
                continue
            for n in r["shards"]["nodes"][1:]:
                cache = n.get("cache") or {}
                pulled, restore = cache.get("migration") or {}, cache.get("shard_restore") or {}
                out.append({"leader": r["node_id"], "rank": n["rank"], "node": n["node_id"],
                            "blocks": pulled.get("blocks", 0), "bytes": pulled.get("bytes", 0),
                            "failures": pulled.get("failures", 0), "reads": restore.get("reads", 0),
                            "late_reads": restore.get("late_reads", 0)})
        if not expect or any(f["blocks"] for f in out) or time.monotonic() > deadline:
            return out
        time.sleep(1)


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    p.add_argument("--concurrency", type=int, default=4, help="requests sent at once")
    p.add_argument("--model", default="tiny-dense", help="the model the fleet serves")
    p.add_argument("--shards", type=int, default=1, help="nodes per replica (2 replicas: 2 x this many nodes)")
    p.add_argument("--kv-codec", nargs="+", default=["native"],
                   help="the fleet's --kv-codec; several (native tq4) measure each on its own fleet in this run")
    a = p.parse_args(argv)
    rows = {codec: run(a, codec) for codec in a.kv_codec}
    if len(rows) > 1 and all("pulled_ttft_p50_s" in r for r in rows.values()):
        base = rows[a.kv_codec[0]]
        for codec, r in list(rows.items())[1:]:
            print(f"{codec} vs {a.kv_codec[0]}: pulled TTFT {r['pulled_ttft_p50_s'] / base['pulled_ttft_p50_s']:.2f}x, "
                  f"bytes moved {r['migrated_bytes'] / max(base['migrated_bytes'], 1):.2f}x")
    write_json(a.json, "migrate", rows[a.kv_codec[0]] if len(rows) == 1 else {"by_codec": rows})
    return 0
