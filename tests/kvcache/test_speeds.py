"""Measured speeds saved on the node: a restart starts from them; a bad file is ignored, never trusted."""

import json

from cluster.kvcache.costs import Costs
from cluster.kvcache.speeds import Speeds, load_speeds, save_speeds, speeds_path

NS = bytes(range(32))
OTHER = bytes(32)


def test_speeds_saved_for_a_fingerprint_load_back_for_it_alone(tmp_path):
    path = speeds_path(tmp_path, NS)
    assert path == tmp_path / "speeds" / f"{NS.hex()}.json"
    save_speeds(path, Speeds(namespace=NS.hex(), prefill_tps=25000.0, ram_bps=2.5e11, disk_bps=1.7e9, move_bps=1.4e9))
    loaded = load_speeds(path, NS)
    assert (loaded.prefill_tps, loaded.ram_bps, loaded.disk_bps, loaded.move_bps) == (25000.0, 2.5e11, 1.7e9, 1.4e9)
    assert loaded.saved > 0 and loaded.measured()
    assert load_speeds(path, OTHER) is None  # another fingerprint's file under this name: not ours
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_missing_corrupt_or_malformed_file_is_no_speeds(tmp_path):
    path = speeds_path(tmp_path, NS)
    assert load_speeds(path, NS) is None
    path.parent.mkdir(parents=True)
    for bad in (b"\x00\xff not json", json.dumps({"namespace": NS.hex(), "disk_bps": -1}).encode(),
                json.dumps({"namespace": NS.hex(), "disk_bps": 1e9, "extra": 1}).encode(), b"[]"):
        path.write_bytes(bad)
        assert load_speeds(path, NS) is None


def test_costs_seeded_from_saved_speeds_predict_at_once_and_keep_averaging():
    costs = Costs(prefill_tps=lambda: 25000.0)
    assert costs.predict(8192, 7680, 0, 1 << 30) is None  # nothing measured: no prediction, the hit is taken
    costs.seed(Speeds(namespace=NS.hex(), ram_bps=2e11, disk_bps=1.7e9, move_bps=1.4e9))
    restore, cold = costs.predict(8192, 7680, 0, 1 << 30)
    assert restore > cold and not costs.restore_pays(8192, 7680, 0, 1 << 30)
    costs.observe("move", 1 << 30, (1 << 30) / 2.4e9)
    assert costs.move_bps == 0.7 * 1.4e9 + 0.3 * 2.4e9
    costs.observe("disk", 1 << 30, (1 << 30) / 2.7e9)  # a seeded read speed is stale (costs.RESAMPLE_S): replaced
    assert abs(costs.disk_bps - 2.7e9) < 1.0
    costs.observe("disk", 1 << 30, (1 << 30) / 1.7e9)  # measured here, recently: averaged
    assert abs(costs.disk_bps - (0.7 * 2.7e9 + 0.3 * 1.7e9)) < 1.0
    snap = costs.snapshot(NS)
    assert (snap.namespace, snap.prefill_tps, snap.ram_bps, snap.move_bps) == (NS.hex(), 25000.0, 2e11, costs.move_bps)
    assert snap.same(snap.model_copy(update={"saved": 5.0})) and not snap.same(None)
