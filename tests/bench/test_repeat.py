"""bench repeat on a tiny model: each decode-attention variant runs, the ops one takes effect, and on the CPU
every cold run repeats bit for bit."""

import importlib

from cluster.bench import repeat
from cluster.bench.common import load
from cluster.engine.schedule import on_gpu


def test_every_variant_runs_and_the_cpu_repeats_itself(data_dir):
    import mlx.core as mx

    model, tok, path = load("tiny-swa", data_dir)
    model.set_dtype(mx.bfloat16)  # the ops variant attends in float32: in bfloat16 that shows
    module = importlib.import_module(type(model).__module__)
    stock = module.scaled_dot_product_attention
    r = repeat.measure(model, tok, path, tokens=100, max_tokens=3, runs=2)
    assert module.scaled_dot_product_attention is stock  # put back
    assert list(r["variants"]) == list(repeat.VARIANTS) and r["schedule"] == ["chunk", 64]
    for v in r["variants"].values():
        assert len(v["distinct_per_step"]) == 3 and all(1 <= d <= 2 for d in v["distinct_per_step"])
    assert r["variants"]["stock"]["gap_vs_stock"] == 0.0 and r["variants"]["ops"]["gap_vs_stock"] > 0.0
    if not on_gpu():
        assert all(v["repeatable"] and v["largest_gap"] == 0.0 for v in r["variants"].values())
