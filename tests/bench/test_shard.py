"""`mlx-fleet bench shard` at a size that runs in seconds: the JSON it writes, and the link estimates."""

import json

from cluster.bench import shard


def test_a_pipelined_run_reports_both_sides_and_each_steps_communication(data_dir, load_builtin, tmp_path):
    load_builtin("tiny-hybrid")  # built in the data dir before the rank processes load it
    out = tmp_path / "shard.json"
    assert shard.main(["--data-dir", str(data_dir), "--model", "tiny-hybrid", "--mode", "pipeline", "--rounds", "1",
                       "--concurrency", "1", "--prompt-tokens", "32", "--max-tokens", "4", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert (results["model"], results["mode"]) == ("tiny-hybrid", "pipeline")
    row = results["decode"]["1"]
    assert row["sharded_vs_whole"] == round(row["sharded"] / row["whole"], 2)
    assert 0 < row["communication_ms"] < row["step_ms"]
    assert results["ttft_sharded_vs_whole"] == round(results["sharded"]["ttft_s"] / results["whole"]["ttft_s"], 2)
    assert set(results["mac_links_ms_per_step"]) == set(shard.LINKS)


def test_mac_link_estimates_price_two_sums_a_layer_against_one_hand_off_a_forward():
    bandwidth, latency = shard.LINKS["ring over 10 GbE"]
    est = shard.estimates(layers=28, hidden=1024, itemsize=2, rows=[1, 4])["ring over 10 GbE"]
    message = latency + 4 * 1024 * 2 / bandwidth
    assert est["tensor"][4] == round(1e3 * 28 * 2 * 2 * message, 3)  # 2 all_sums a layer, 2 messages each
    assert est["pipeline"][4] == round(1e3 * 3 * message, 3)  # a hand-off, then an all_gather of 2 messages
    assert shard.per_step("tensor", 28, 1e-4) == 28 * 2 * 1e-4 and shard.per_step("pipeline", 28, 1e-4) == 1e-4
