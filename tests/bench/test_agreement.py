"""bench agreement on a tiny model: solo and batched runs of the same prompts, compared row by row."""

from cluster.bench import agreement
from cluster.bench.common import load
from cluster.engine.schedule import on_gpu


def test_the_batched_run_batches_and_each_row_is_compared_with_its_solo_run(data_dir):
    model, tok, _ = load("tiny-dense", data_dir)
    r = agreement.measure(model, tok, [p[:40] for p in agreement.prompts_for(0, 5)], max_tokens=4, concurrency=5)
    assert r["prompts"] == len(r["rows"]) == 5
    # the batched run's own mean batch (the solo runs' one-row steps are not in it)
    assert 2.5 < r["mean_batch"] <= 5, r["mean_batch"]
    assert r["identical"] == sum(x["identical"] for x in r["rows"])
    if not on_gpu():  # the CPU computes a row the same way whatever the batch: bitwise, every row
        assert (r["identical"], r["bitwise_rows"], r["logit_diff_max"]) == (5, 5, 0.0)
