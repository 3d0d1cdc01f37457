"""StatsExporter: running totals become counter increments, and a total first seen at 0 is exported at 0."""

import pytest

from cluster import metrics


def test_totals_become_increments_and_a_zero_total_is_exported(monkeypatch):
    calls = []
    monkeypatch.setattr(metrics, "inc", lambda name, value=1.0, **tags: calls.append(("inc", name, value, tags)))
    monkeypatch.setattr(metrics, "zero", lambda name, **tags: calls.append(("zero", name, tags)))
    exp = metrics.StatsExporter()
    exp.total("mlx_fleet_cache_evictions", 0, node="n", tier="ram")
    exp.total("mlx_fleet_cache_evictions", 0, node="n", tier="ram")
    exp.total("mlx_fleet_cache_evictions", 3, node="n", tier="ram")
    exp.total("mlx_fleet_cache_evictions", 5, node="n", tier="ram")
    exp.total("mlx_fleet_cache_evictions", 2, node="n", tier="ram")  # the replica restarted: counted from 0
    exp.total("mlx_fleet_tokens", 7, kind="prompt")
    exp.total("mlx_fleet_tokens", None, kind="cached")  # not known: nothing
    tags = {"node": "n", "tier": "ram"}
    assert calls == [("zero", "mlx_fleet_cache_evictions", tags),
                     ("inc", "mlx_fleet_cache_evictions", 0.0, tags),
                     ("inc", "mlx_fleet_cache_evictions", 3.0, tags),
                     ("inc", "mlx_fleet_cache_evictions", 2.0, tags),
                     ("inc", "mlx_fleet_cache_evictions", 2, tags),
                     ("inc", "mlx_fleet_tokens", 7.0, {"kind": "prompt"})]


def test_rays_counter_takes_a_zero_through_record():
    """`zero` leans on Ray's private `Counter._record`, because `inc` refuses 0: this Ray still has it."""
    from ray.util.metrics import Counter

    counter = Counter("mlx_fleet_test_zero", description="a test", tag_keys=("k",))
    with pytest.raises(ValueError):
        counter.inc(0.0, tags={"k": "a"})
    counter._record(0.0, tags={"k": "a"})
