"""Summary and plots from records: exact counts, cache-state splits, ratios, and real PNGs."""

import json

import pytest
from PIL import Image

from loadtest.plots import write_plots
from loadtest.stream import Result, cache_state
from loadtest.summary import percentiles, ratios, read_records, summarize


def row(kind="request", ok=True, status=200, ttft=0.5, prompt=200, cached=0, generated=8, t=0.0, match=None,
        workload="shared", node="node-0", reason="miss", error=""):
    total = (ttft or 0.0) + 0.2
    r = {"kind": kind, "ok": ok, "status": status, "error": error, "ttft_s": ttft, "total_s": total,
         "itl_s": 0.02, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": generated,
         "cache_state": cache_state(prompt, cached, 64) if ok else None, "workload": workload, "node": node,
         "reason": reason, "policy": "affinity", "local": cached, "fetched": 0, "t_start": t, "t_end": t + total}
    if kind == "verify":
        r["match"] = match
    return r


@pytest.mark.parametrize("prompt,cached,state", [
    (200, 0, "cold"), (200, 64, "partial"), (200, 192, "full"), (193, 192, "full"), (192, 128, "full"),
    (192, 64, "partial"), (64, 0, "cold"),
])
def test_cache_state_counts_whole_blocks_before_the_last_token(prompt, cached, state):
    assert cache_state(prompt, cached, 64) == state


def test_the_route_header_parses_into_fields():
    r = Result(route="affinity reason=hit local=128 fetched=64 from=node-1-abc")
    assert r.route_fields() == {"policy": "affinity", "reason": "hit", "local": "128", "fetched": "64",
                                "from": "node-1-abc"}
    assert Result().route_fields() == {"policy": ""}


def test_summary_counts_exactly():
    rows = [row(ttft=1.0, cached=0, t=0), row(ttft=0.2, cached=192, t=1), row(ttft=0.4, cached=64, t=2),
            row(ok=False, status=503, ttft=None, error="503 no_replica_available", t=3),
            row(ok=False, status=400, ttft=None, error="400 invalid_value", t=3),
            row(kind="verify", match=True, t=4), row(kind="verify", match=False, t=5),
            row(kind="verify", ok=False, status=500, match=False, t=6)]
    s = summarize(rows)
    assert (s["requests"], s["failures"], s["status_5xx"], s["wrong_answers"]) == (5, 2, 2, 1)
    assert s["replays"] == {"count": 3, "failed": 1}
    assert s["errors"] == {"503 no_replica_available": 1, "400 invalid_value": 1}
    assert s["tokens"] == {"prompt": 600, "cached": 256, "generated": 24, "local": 256, "fetched": 0}
    assert s["reuse_ratio"] == round(256 / 600, 4)
    assert s["cache_states"] == {"cold": 1, "partial": 1, "full": 1}
    assert s["ttft_s_by_cache_state"]["full"] == {"count": 1, "mean": 0.2, "p50": 0.2, "p90": 0.2, "p99": 0.2, "max": 0.2}
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["p50"] == 0.4
    assert s["duration_s"] == 6.0 + 0.7  # first start to last end, replays included


def test_percentiles_are_nearest_rank_and_skip_missing():
    assert percentiles([None]) == {"count": 0}
    p = percentiles([float(i) for i in range(1, 101)] + [None])
    assert (p["count"], p["p50"], p["p90"], p["p99"], p["max"]) == (100, 50.0, 90.0, 99.0, 100.0)


def test_ratios_compare_every_run_to_the_first():
    fast = summarize([row(ttft=0.5, cached=192, t=0), row(ttft=0.5, cached=192, t=1)])
    slow = summarize([row(ttft=1.5, t=0), row(ttft=1.5, t=1)])
    r = ratios({"affinity": fast, "pow2": slow})
    assert list(r) == ["pow2/affinity"]
    assert r["pow2/affinity"]["ttft_p50"] == 3.0 and r["pow2/affinity"]["reuse_ratio"] == 0.0
    assert ratios({"only": fast}) == {}


def test_records_with_a_torn_last_line_are_read(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(row()) + "\n" + json.dumps(row(t=1)) + "\n" + '{"kind": "requ')
    assert len(read_records(path)) == 2


def test_plots_are_real_images_with_data(tmp_path):
    runs = {"affinity": [row(ttft=0.1 + i / 50, cached=(i % 3) * 64, t=i / 2) for i in range(40)],
            "pow2": [row(ttft=0.5 + i / 30, t=i / 2) for i in range(40)]}
    written = write_plots(runs, tmp_path)
    assert [p.name for p in written] == ["ttft.png", "throughput.png", "reuse.png"]
    for p in written:
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
            assert im.width > 400 and im.height > 300
            assert colours is None or len(colours) > 20, p.name  # lines and text, not a blank canvas


def test_no_answered_request_means_no_plot(tmp_path):
    assert write_plots({"affinity": [row(ok=False, status=503, ttft=None)]}, tmp_path) == []
