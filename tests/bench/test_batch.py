"""`mlx-fleet bench batch`, engine part, at a size that runs in seconds: the JSON it writes and its verdicts."""

import json

from cluster.bench import batch


def test_the_engine_comparison_reports_the_median_of_interleaved_rounds(data_dir, tmp_path):
    out = tmp_path / "batch.json"
    assert batch.main(["--data-dir", str(data_dir), "--no-http", "--concurrency", "1", "2", "--max-tokens", "6",
                       "--rounds", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert (results["rounds"], "http" in results) == (3, False)
    for c in ("1", "2"):
        row = results["engine"][c]
        assert row["identical_tokens"] is True
        for way in ("sequential", "batched", "mlx_lm_batch_generate"):
            r = row[way]
            assert len(r["rounds_tokens_per_s"]) == 3
            assert r["tokens_per_s"] == sorted(r["rounds_tokens_per_s"])[1]  # the median round
            assert r["generated"] == 6 * int(c)
        assert row["speedup"] == round(row["batched"]["tokens_per_s"] / row["sequential"]["tokens_per_s"], 2)
