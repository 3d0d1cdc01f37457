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


def test_http_rounds_send_new_prompts_each_round_so_no_prompt_cache_answers(data_dir):
    from cluster.bench.common import load

    _, tok, _ = load("tiny-dense", data_dir)
    rounds = batch.http_prompts(tok, 4, 3, 32)
    texts = [t for r in rounds for t in r]
    assert [len(r) for r in rounds] == [4, 4, 4] and len(set(texts)) == 12
    assert batch.WARM_UP not in texts and rounds == batch.http_prompts(tok, 4, 3, 32)  # the same for both servers


def test_texts_agree_but_for_the_leading_space_mlx_lm_server_drops():
    ours = [[" a cat", " sat"], [" on", "\nthe mat"]]
    assert batch.same_texts([["a cat", "sat"], ["on", "\nthe mat"]], ours)
    assert not batch.same_texts([["a cat", "sat"], ["on", "the mat"]], ours)
    assert not batch.same_texts([["a cat", "sat"]], ours)
