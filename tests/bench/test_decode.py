"""bench decode on a tiny model: both ways run at every context and row count, and the route is put back."""

from cluster.bench import decode
from cluster.bench.common import load
from cluster.engine import invariant


def test_both_ways_run_and_the_route_is_put_back(data_dir):
    model, tok, _ = load("tiny-dense", data_dir)
    was = invariant.routes_one_query()
    r = decode.measure(model, tok, contexts=[40, 300], rows=[1, 2], steps=2, prefill_step=64)
    assert invariant.routes_one_query() is was
    assert [(x["context"], x["rows"]) for x in r] == [(40, 1), (40, 2), (300, 1), (300, 2)]
    for x in r:
        assert x["steps"] == 2 and x["kernel_steps_per_s"] > 0 and x["mlx_lm_steps_per_s"] > 0
        assert x["kernel_vs_mlx_lm"] == x["kernel_steps_per_s"] / x["mlx_lm_steps_per_s"]
        assert len(x["turns"]["kernel"]) == len(x["turns"]["mlx_lm"]) == 2 and 1 <= x["rows_at_end"] <= x["rows"]
        assert x["kernel_steps_per_s"] == max(x["turns"]["kernel"]) and x["mlx_lm_steps_per_s"] == max(x["turns"]["mlx_lm"])
