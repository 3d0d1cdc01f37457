"""Cache-affinity routing against power-of-two choices, on the same shared-prefix workload, in one run.

    mlx-fleet bench routing [--nodes 3] [--conversations 36] [--turns 3] [--systems 12] [--system-words 300]
                            [--doc-words 800] [--concurrency 3] [--ram-mb 16] [--model tiny-dense] [--json out.json]

For each policy a fresh local fleet starts (`mlx-fleet up --routing ...`, RAM
tiers smaller than the workload) and runs the same seeded workload: chat
conversations, each on one of a few shared system prompts and with its own
long document in its first turn, turn after turn (the history grows with
every reply), several conversations at once.
Per request it records the time to the first streamed token, cached and
prompt tokens, and the serving node. Reported per policy:
- cached-token ratio, and its fraction of the oracle: the tokens the best
  possible routing could have restored (the longest prefix computed anywhere
  in the fleet before the request - prompts and replies - in whole blocks);
- TTFT p50 and p90;
- max node load / mean (requests per node).
And the ratios affinity vs pow2. Goals: >= 90% of the oracle, TTFT p50 3x
better, max/mean <= 1.5.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cluster.bench.common import parser, write_json
from cluster.fleet.spawned import SpawnedFleet
from cluster.store.hashing import chain_ids

WORDS = ("fleet cache block token prompt node replica route restore model memory disk network apple metal prefix "
         "window state attention system user assistant document answer question stream").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def workload(seed: int, conversations: int, turns: int, systems: int, words: int, doc_words: int) -> list[dict]:
    """Conversations on shared system prompts; each brings its own document in its first turn (RAG,
    an agent's tool output, a pasted file), and later turns ask short questions about it."""
    rng = random.Random(seed)
    prompts = [f"System {s}: {text(rng, words)}" for s in range(systems)]
    return [{"system": prompts[c % systems],
             "questions": [f"Document {c}: {text(rng, doc_words)}\nQuestion 0 of {c}: {text(rng, 12)}?"]
             + [f"Turn {t} of {c}: {text(rng, 12)}?" for t in range(1, turns)]}
            for c in range(conversations)]


class Oracle:
    """The cached tokens the best possible routing could reach: any prefix computed anywhere before."""

    def __init__(self, tokenizer, namespace: bytes, block_tokens: int):
        self.tok, self.ns, self.B = tokenizer, namespace, block_tokens
        self.seen: set[bytes] = set()
        self.lock = threading.Lock()

    def tokens(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 return_dict=False))

    def best(self, prompt: list[int]) -> int:
        ids = chain_ids(self.ns, prompt, self.B)
        with self.lock:
            hit = 0
            for i in ids:
                if i not in self.seen:
                    break
                hit += 1
        return min(hit * self.B, len(prompt) - 1)

    def computed(self, prompt: list[int]) -> None:
        with self.lock:
            self.seen.update(chain_ids(self.ns, prompt, self.B))


def run_policy(policy: str, a, work: Path, plan: list[dict]) -> dict:
    with SpawnedFleet(work / policy, a.nodes, (a.model,), policy, ("--cache-ram-gb", str(a.ram_mb / 1024))) as fleet:
        from transformers import AutoTokenizer

        status = fleet.status()
        cache = status["replicas"][0]["cache"]
        oracle = Oracle(AutoTokenizer.from_pretrained(str(fleet.data_dir / "models" / a.model)),
                        bytes.fromhex(cache["namespace_hex"]), cache["block_tokens"])
        records: list[dict] = []
        with httpx.Client(base_url=fleet.url, timeout=600, trust_env=False) as http:
            def converse(conv: dict) -> None:
                messages = [{"role": "system", "content": conv["system"]}]
                for q in conv["questions"]:
                    messages.append({"role": "user", "content": q})
                    prompt = oracle.tokens(messages)
                    best = oracle.best(prompt)
                    rec = ask(http, a.model, messages)
                    rec.update(oracle=best, tokens=len(prompt))
                    records.append(rec)
                    messages.append({"role": "assistant", "content": rec["text"]})
                    # What was computed: the prompt and the reply (the reply as the next turn tokenizes it).
                    oracle.computed(oracle.tokens(messages, generation_prompt=False))

            t0 = time.monotonic()
            with ThreadPoolExecutor(a.concurrency) as pool:
                list(pool.map(converse, plan))
            wall = time.monotonic() - t0
    return summarize(policy, records, wall)


def ask(http: httpx.Client, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first, parts, usage = None, [], {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        node = r.headers["x-fleet-node"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    first = first or time.monotonic()
                    parts.append(c["delta"]["content"])
    return {"node": node, "ttft_s": (first or time.monotonic()) - t0, "text": "".join(parts),
            "prompt": usage.get("prompt_tokens", 0), "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def summarize(policy: str, records: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft_s"] for r in records)
    load = Counter(r["node"] for r in records)
    cached, prompt, oracle = (sum(r[k] for r in records) for k in ("cached", "prompt", "oracle"))
    return {"policy": policy, "requests": len(records), "wall_s": wall,
            "cached_ratio": cached / prompt, "oracle_ratio": oracle / prompt,
            "of_oracle": cached / oracle if oracle else None,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "max_over_mean_load": max(load.values()) / (len(records) / len(load)), "per_node": dict(load)}


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--nodes", type=int, default=3, help="fleet nodes")
    p.add_argument("--conversations", type=int, default=36, help="conversations in the workload")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation")
    p.add_argument("--systems", type=int, default=12, help="shared system prompts")
    p.add_argument("--system-words", type=int, default=300, help="words per shared system prompt (~1.3 tokens each)")
    p.add_argument("--doc-words", type=int, default=800, help="words of each conversation's own document")
    p.add_argument("--concurrency", type=int, default=3, help="conversations in progress at once")
    p.add_argument("--ram-mb", type=float, default=16, help="each replica's RAM tier in MiB, smaller than the workload")
    p.add_argument("--model", default="tiny-dense", help="the model the fleets serve")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    a = p.parse_args(argv)
    plan = workload(a.seed, a.conversations, a.turns, a.systems, a.system_words, a.doc_words)
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as work:
        rows = [run_policy(policy, a, Path(work), plan) for policy in ("affinity", "pow2")]
    print(f"{a.conversations} conversations x {a.turns} turns on {a.systems} system prompts ({a.system_words} words) "
          f"with a {a.doc_words}-word document each, {a.nodes} nodes, {a.concurrency} at once, RAM tier {a.ram_mb} MiB "
          "per replica")
    print(f"{'policy':<10}{'cached':>8}{'oracle':>8}{'of oracle':>11}{'ttft p50':>10}{'ttft p90':>10}{'max/mean':>10}")
    for r in rows:
        print(f"{r['policy']:<10}{r['cached_ratio']:>8.1%}{r['oracle_ratio']:>8.1%}{r['of_oracle'] or 0:>11.1%}"
              f"{r['ttft_p50_s']:>9.3f}s{r['ttft_p90_s']:>9.3f}s{r['max_over_mean_load']:>10.2f}")
    aff, p2 = rows
    print(f"affinity vs pow2: TTFT p50 {p2['ttft_p50_s'] / aff['ttft_p50_s']:.2f}x better (goal >= 3), "
          f"{aff['of_oracle']:.1%} of the oracle's cached tokens (goal >= 90%), "
          f"max/mean load {aff['max_over_mean_load']:.2f} (goal <= 1.5)")
    write_json(a.json, "routing", {"settings": vars(a) | {"data_dir": str(a.data_dir), "json": str(a.json)},
                                   "rows": rows})
    return 0
