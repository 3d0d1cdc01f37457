"""Batched greedy answers against the same requests alone, in one run: how often they are the same.

    mlx-fleet bench agreement [--model bench-qwen3-0.6b-bf16] [--prompts 200] [--concurrency 16]
                              [--max-tokens 32] [--json out.json]

A GPU picks its kernels by shape: a row decoded in a batch of 16 is multiplied in another kernel than the
same row alone, rounds differently in the last bits, and where two logits are near a tie the greedy token
flips; from there the answers part. On seeded random prompts of 16 to 512 tokens this measures:
- solo: each request alone in a replica's Scheduler (its decode batch holds one row);
- batched: all of them submitted at once, decoded up to --concurrency rows at a time (rows join and leave
  as in serving).
Reported: the share of prompts whose greedy tokens are identical, where the first difference falls, and
the largest logit difference of the steps before it (0.0: bitwise). No goal: it is the figure the README
and docs/gpu.md publish for the default mode.
"""

from __future__ import annotations

import random
import statistics

from cluster.bench.common import environment, load, parser, write_json


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(16, 513))] for _ in range(n)]


def measure(model, tok, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    import mlx.core as mx

    from cluster.engine.cold_session import ColdSession
    from cluster.engine.events import Delta
    from cluster.engine.request import GenerationParams
    from cluster.engine.scheduler import Scheduler
    from cluster.engine.sequence import Sequence

    def seq(p):
        return Sequence(p, GenerationParams(max_tokens=max_tokens, record_logits=True), model, tok, ColdSession(model))

    def tokens(events):
        return [t for e in events if isinstance(e, Delta) for t in e.token_ids]

    scheduler = Scheduler(name="mlx-fleet-bench", batching=True, decode_concurrency=concurrency)
    try:
        scheduler.run_all([seq(prompts[0])])  # warm-up: compiled kernels, allocator
        solo_seqs = [seq(p) for p in prompts]
        solo = [tokens(scheduler.run_all([s])[0]) for s in solo_seqs]
        batch_seqs = [seq(p) for p in prompts]
        steps, rows_in = scheduler.batched_steps, scheduler.batched_rows  # the batched run's own mean batch
        batched = [tokens(ev) for ev in scheduler.run_all(batch_seqs, timeout_s=3600)]
        mean_batch = round((scheduler.batched_rows - rows_in) / max(1, scheduler.batched_steps - steps), 2)
        rows = []
        for a, b, sa, sb in zip(solo, batched, solo_seqs, batch_seqs):
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            upto = len(a) if first is None else first + 1
            diff = scheduler.run(lambda: max(mx.abs(sa.logits[i].astype(mx.float32) - sb.logits[i].astype(mx.float32))
                                             .max().item() for i in range(upto)))
            rows.append({"identical": a == b, "first_difference": first, "logit_diff": diff})
        scheduler.run(lambda: [s.logits.clear() for s in solo_seqs + batch_seqs])  # their arrays: the model thread's
    finally:
        scheduler.stop()
    parted = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    return {"prompts": len(prompts), "identical": sum(r["identical"] for r in rows),
            "identical_share": sum(r["identical"] for r in rows) / len(rows),
            "first_token_identical": sum(r["first_difference"] != 0 for r in rows),
            "first_difference_median": statistics.median(parted) if parted else None,
            "logit_diff_max": max(r["logit_diff"] for r in rows),
            "logit_diff_median": statistics.median(r["logit_diff"] for r in rows),
            "bitwise_rows": sum(r["logit_diff"] == 0.0 for r in rows), "mean_batch": mean_batch,
            "rows": rows}


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--model", default="bench-qwen3-0.6b-bf16", help="built-in model")
    p.add_argument("--prompts", type=int, default=200, help="prompts (seeded, 16-512 random tokens each)")
    p.add_argument("--concurrency", type=int, default=16, help="rows decoded at once in the batched run")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    a = p.parse_args(argv)
    model, tok, _ = load(a.model, a.data_dir)
    r = measure(model, tok, prompts_for(a.seed, a.prompts), a.max_tokens, a.concurrency)
    print(f"{a.model}: {r['identical']} of {r['prompts']} batched greedy answers ({r['identical_share']:.1%}) "
          f"identical to the same requests alone ({a.max_tokens} tokens, up to {a.concurrency} rows, mean batch "
          f"{r['mean_batch']}); first tokens identical in {r['first_token_identical']}; bitwise logits in "
          f"{r['bitwise_rows']}; logit difference before the first parting: median {r['logit_diff_median']:.3g}, "
          f"max {r['logit_diff_max']:.3g}; parted at token {r['first_difference_median']} (median)")
    write_json(a.json, "agreement", {"model": a.model, "max_tokens": a.max_tokens, "concurrency": a.concurrency,
                                     "environment": environment(), **r})
    return 0
