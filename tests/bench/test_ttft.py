"""bench ttft on a tiny model: each figure is of the run it names (every capture cold, every hit restored), and
the hits' logits are the cold run's bitwise."""

import statistics

from cluster.bench import ttft
from cluster.kvcache import costs, spill


def test_a_row_has_cold_captures_and_bitwise_hits(tmp_path, monkeypatch):
    # Spills go at once, as on a slow CPU prefill where blocks are overdue before the prompt ends: the second
    # capture must still start from an empty disk (measure raises if a capture finds anything cached)
    monkeypatch.setattr(spill, "SPILL_DELAY_S", 0.0)
    # No speed is measured, so every chosen run restores: here a spill's write speed (fsync'd, one batch or
    # two, by timing) could otherwise lose to a tiny model's prefill and make a chosen run recompute.
    monkeypatch.setattr(costs, "MIN_BYTES", 1 << 40)
    row = ttft.measure("tiny-dense", tmp_path, tokens=256, block_tokens=64, repeat=2)
    assert (row["cached_tokens"], row["disk_cached_runs"], row["chosen_cached_runs"]) == (255, [255, 255], [255, 255])
    assert row["choices"] == {"restore": 4, "recompute": 0}  # the RAM hits and the chosen runs (the forced: their own)
    assert (row["spilled"], row["dropped_spills"]) == (4, 0)
    assert row["same_first_token"] and row["ram_logit_diff"] == 0.0 and row["disk_logit_diff"] == 0.0
    assert [len(row["runs_s"][k]) for k in ("cold", "capture", "ram", "disk", "chosen")] == [2, 2, 2, 2, 2]
    assert row["chosen_worst_vs_cold"] == max(row["runs_s"]["chosen"]) / row["cold_s"]
    assert row["chosen_worst_vs_capture"] == max(row["runs_s"]["chosen"]) / row["capture_s"]
    # both disk runs restored: the disk figure is theirs, and, every chosen run restoring, no recompute figure
    assert row["disk_s"] == statistics.median(row["runs_s"]["disk"]) and row["disk_recompute_s"] is None
