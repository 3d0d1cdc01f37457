"""The summary of a load test, from the per-request records the locust users wrote.

One block per run (a routing policy), then ratios between runs:

    {"runs": {"affinity": {requests, failures, status_5xx, wrong_answers, tokens, reuse_ratio,
                           ttft_s, ttft_s_by_cache_state, ttft_s_by_workload, itl_s, total_s, ...},
              "pow2": {...}},
     "ratios": {"pow2/affinity": {"ttft_p50": 3.1, ...}}}

Every number comes from what the server reported per request (usage, headers) or
what the client timed; nothing is estimated.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

from loadtest.stream import CACHE_STATES


def read_records(path: Path) -> list[dict]:
    """The JSON lines a run wrote (a torn last line, from a killed worker, is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def percentiles(values: Iterable[Optional[float]]) -> dict:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"count": 0}

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))], 4)

    return {"count": len(xs), "mean": round(sum(xs) / len(xs), 4), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": round(xs[-1], 4)}


def summarize(records: list[dict]) -> dict:
    """One run's numbers."""
    asked = [r for r in records if r["kind"] == "request"]
    ok = [r for r in asked if r["ok"]]
    replays = [r for r in records if r["kind"] == "verify"]
    start = min((r["t_start"] for r in records), default=0.0)
    duration = max((r["t_end"] for r in records), default=0.0) - start
    tokens = {"prompt": sum(r["prompt_tokens"] for r in ok), "cached": sum(r["cached_tokens"] for r in ok),
              "generated": sum(r["completion_tokens"] for r in ok), "local": sum(r["local"] for r in ok),
              "fetched": sum(r["fetched"] for r in ok)}
    return {
        "requests": len(asked),
        "failures": len(asked) - len(ok),
        "status_5xx": sum(1 for r in records if r["status"] >= 500),
        "errors": dict(Counter(r["error"] or f"HTTP {r['status']}" for r in asked if not r["ok"])),
        "wrong_answers": sum(1 for r in replays if r["ok"] and not r["match"]),
        "replays": {"count": len(replays), "failed": sum(1 for r in replays if not r["ok"])},
        "duration_s": round(duration, 3),
        "throughput_rps": round(len(ok) / duration, 4) if duration > 0 else 0.0,
        "generated_tokens_per_s": round(tokens["generated"] / duration, 2) if duration > 0 else 0.0,
        "tokens": tokens,
        "reuse_ratio": round(tokens["cached"] / tokens["prompt"], 4) if tokens["prompt"] else 0.0,
        "cache_states": {s: sum(1 for r in ok if r["cache_state"] == s) for s in CACHE_STATES},
        "ttft_s": percentiles(r["ttft_s"] for r in ok),
        "ttft_s_by_cache_state": {s: percentiles(r["ttft_s"] for r in ok if r["cache_state"] == s) for s in CACHE_STATES},
        "ttft_s_by_workload": {w: percentiles(r["ttft_s"] for r in ok if r["workload"] == w)
                               for w in sorted({r["workload"] for r in ok})},
        "itl_s": percentiles(r["itl_s"] for r in ok),
        "total_s": percentiles(r["total_s"] for r in ok),
        "reasons": dict(Counter(r["reason"] for r in ok)),
        "nodes": dict(Counter(r["node"] for r in ok)),
    }


def ratios(runs: dict[str, dict]) -> dict:
    """Every other run against the first (the reference, normally affinity): >1 means the other is slower."""
    if len(runs) < 2:
        return {}
    (ref_name, ref), *others = runs.items()
    out = {}
    for name, run in others:
        out[f"{name}/{ref_name}"] = {
            "ttft_p50": _ratio(run["ttft_s"].get("p50"), ref["ttft_s"].get("p50")),
            "ttft_p90": _ratio(run["ttft_s"].get("p90"), ref["ttft_s"].get("p90")),
            "total_p50": _ratio(run["total_s"].get("p50"), ref["total_s"].get("p50")),
            "throughput": _ratio(run["throughput_rps"], ref["throughput_rps"]),
            "reuse_ratio": _ratio(run["reuse_ratio"], ref["reuse_ratio"]),
        }
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None
