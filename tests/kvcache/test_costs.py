"""Restore or recompute: the faster by the replica's measured speeds, and counted."""

from cluster.kvcache.costs import Costs

GB = 1 << 30


def costs(tps=10_000.0, ram=50e9, disk=2e9) -> Costs:
    return Costs(prefill_tps=lambda: tps, ram_bps=ram, disk_bps=disk)


def test_a_ram_hit_beats_recomputing():
    c = costs()
    restore, cold = c.predict(8192, 8192 - 512, GB, 0)
    assert restore == GB / 50e9 + 512 / 10_000 and cold == 8192 / 10_000
    assert c.restore_pays(8192, 8192 - 512, GB, 0) and c.choices == {"restore": 1, "recompute": 0}


def test_a_slow_disk_loses_to_a_fast_prefill():
    c = costs(tps=40_000.0, disk=0.5e9)  # 2k tokens: 0.05 s to compute, 0.3 GB to read at 0.5 GB/s
    assert not c.restore_pays(2048, 2048, 0, int(0.3e9))
    assert c.restore_pays(2048, 2048, int(0.3e9), 0)  # the same bytes on the device: restore
    assert c.choices == {"restore": 1, "recompute": 1}


def test_bytes_read_in_pay_their_move_to_the_device_at_its_measured_speed():
    c = costs(tps=25_000.0, ram=250e9, disk=1.5e9)  # the H200's 8B: 8k tokens are 1.2 GB of KV
    restore, cold = c.predict(8192, 7680, 0, int(1.2e9))
    assert restore == 1.2e9 / 1.5e9 + 1.2e9 / 250e9 + 512 / 25_000  # until measured, the RAM speed stands in
    c.observe("move", int(1.2e9), 0.87)  # CUDA migrates managed pages: as slow as the disk
    restore, _ = c.predict(8192, 7680, 0, int(1.2e9))
    assert restore == 1.2e9 / 1.5e9 + 1.2e9 / (1.2e9 / 0.87) + 512 / 25_000 and restore > cold
    assert c.stats()["move_gbps"] == round(1.2e9 / 0.87 / 1e9, 3)


def test_moves_beside_the_reads_cost_a_batch_then_the_slower_of_the_two_then_a_build():
    c = costs(tps=25_000.0, ram=250e9, disk=1.5e9)
    batch = 64 << 20  # moved as they are read (uploads.py)
    c.overlap_bytes, c.move_bps = batch, 7.9e9
    d = int(1.2e9)
    build = d / 250e9  # from the moved blocks, as from RAM
    assert c.predict(8192, 7680, 0, d)[0] == batch / 1.5e9 + batch / 7.9e9 + (d - batch) / 1.5e9 + build + 512 / 25_000
    c.move_bps = 1.0e9  # a move slower than the read paces the rest instead
    assert c.predict(8192, 7680, 0, d)[0] == batch / 1.5e9 + batch / 1.0e9 + (d - batch) / 1.0e9 + build + 512 / 25_000
    small = 1 << 20  # under a batch: read, then moved
    assert c.predict(8192, 8160, 0, small)[0] == small / 1.5e9 + small / 1.0e9 + 0 / 1.0e9 + small / 250e9 + 32 / 25_000


def test_nothing_measured_yet_takes_the_hit():
    for c in (Costs(), costs(ram=0.0), costs(disk=0.0)):
        assert c.predict(2048, 2048, 1, 1) is None and c.restore_pays(2048, 2048, 1, 1)


def test_speeds_are_moving_averages_of_big_enough_transfers():
    c = Costs()
    c.observe("disk", 1000, 0.001)  # too small to say anything about bandwidth
    assert c.disk_bps == 0.0
    c.observe("disk", 2 * GB, 1.0)
    c.observe("disk", 2 * GB, 2.0)
    assert c.disk_bps == 0.7 * 2 * GB + 0.3 * GB


def test_until_a_read_is_measured_the_spills_write_speed_stands_in_for_it():
    c = costs(tps=25_000.0, ram=250e9, disk=0.0)  # the H100's 8B: a first disk hit took 1.0 s against cold's 0.3
    assert c.predict(8192, 7680, 0, int(1.2e9)) is None and not c.read_worth_sampling()  # nothing to go by: taken
    c.observe("write", int(1.2e9), 1.2)
    restore, cold = c.predict(8192, 7680, 0, int(1.2e9))
    assert restore == 1.2e9 / 1e9 + 1.2e9 / 250e9 + 512 / 25_000 and restore > cold
    assert c.read_worth_sampling() and not c.restore_pays(8192, 7680, 0, int(1.2e9))
    c.observe("disk", int(1.2e9), 0.4)  # the read, once measured, decides
    assert not c.read_worth_sampling() and c.predict(8192, 7680, 0, int(1.2e9))[0] == 1.2e9 / 3e9 + 1.2e9 / 250e9 + 512 / 25_000
    assert c.stats()["write_gbps"] == 1.0


def test_a_read_speed_goes_stale_and_one_from_before_a_restart_is_stale_at_once(monkeypatch):
    from cluster.kvcache import costs as costs_module
    from cluster.kvcache.speeds import Speeds

    now = [1000.0]
    monkeypatch.setattr(costs_module.time, "monotonic", lambda: now[0])
    c = Costs()
    c.seed(Speeds(namespace="00", disk_bps=0.3e9, write_bps=1e9))  # saved by the process before
    assert c.read_at == 0.0 and c.read_worth_sampling()
    c.observe("disk", GB, 0.5)  # the seeded 0.3 GB/s is replaced, not averaged
    assert c.read_at == 1000.0 and c.disk_bps == GB / 0.5 and not c.read_worth_sampling()
    now[0] += costs_module.RESAMPLE_S
    assert not c.read_worth_sampling()
    now[0] += 1
    assert c.read_worth_sampling()
    c.observe("write", GB, 1.0)  # a write is no read
    assert c.read_worth_sampling()
    c.observe("disk", GB, 0.25)  # a stale speed is replaced by the new measurement, not averaged with it
    assert c.disk_bps == GB / 0.25 and not c.read_worth_sampling()
