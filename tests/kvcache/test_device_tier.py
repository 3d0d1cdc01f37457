"""The device RAM tier's invariants: a RAM hit makes no host copy and no check, a spill never blocks
the model thread, and the restore-or-recompute choice follows the predicted costs."""

import threading

import pytest

from cluster.kvcache import device_blocks
from cluster.store import arrays, block_format
from tests.kvcache.conftest import forget_ram, prompt_of


def refuse(what):
    def call(*args, **kwargs):
        raise AssertionError(f"a RAM hit called {what}")
    return call


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid"])  # full, sliding, recurrent layers
def test_a_ram_hit_makes_no_host_copy_and_no_check(disk_harness, monkeypatch, name):
    h = disk_harness(name)
    prompt = prompt_of(300)
    h.warm(prompt)
    full = h.warm(prompt).cached  # a hit, checked nothing yet: what the next one restores
    assert h.pc.tiers.disk.flush(30)  # everything spilled: the next hit has nothing to write either
    for module, fn in ((device_blocks, "host_views"), (device_blocks, "to_mlx"), (device_blocks, "from_host"),
                       (arrays, "to_mlx"), (block_format, "decode"), (block_format, "encode")):
        monkeypatch.setattr(module, fn, refuse(f"{module.__name__}.{fn}"))
    monkeypatch.setattr(h.pc.tiers.disk, "get_many", refuse("the disk"))
    warm = h.warm(prompt)
    monkeypatch.undo()
    assert warm.cached == full > 0
    assert h.pc.stats()["ram"]["holds"] == "device arrays"
    h.assert_same(warm, h.cold(prompt))


def test_a_disk_hit_moves_each_block_to_the_device_once(disk_harness, monkeypatch):
    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    forget_ram(h)
    moved = []
    real = device_blocks.from_host
    monkeypatch.setattr(device_blocks, "from_host", lambda block, runs: moved.append(block.id) or real(block, runs))
    first, second = h.warm(prompt), h.warm(prompt)
    assert first.cached == second.cached > 0 and h.pc.tiers.disk.counters["disk_hits"] == len(moved)
    assert len(moved) == len(set(moved)) == -(-first.cached // h.B)  # the second hit was all in RAM
    h.assert_same(second, h.cold(prompt))


def test_a_spill_never_blocks_the_model_thread(disk_harness, monkeypatch):
    h = disk_harness("tiny-hybrid")
    disk = h.pc.tiers.disk
    gate, real_write = threading.Event(), disk.link.write
    disk.link.write = lambda ns, items: (gate.wait(), real_write(ns, items))[1]  # a disk that does not answer
    encoders, real_encode = [], block_format.encode
    monkeypatch.setattr(block_format, "encode",
                        lambda block: encoders.append(threading.current_thread().name) or real_encode(block))
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)  # captures, and queues its spills, while the disk hangs
    again = h.warm(prompt)
    assert again.cached > 0 and disk.counters["spilled"] == 0  # served from RAM while nothing is written yet
    gate.set()
    assert disk.flush(30) and disk.counters["spilled"] == len(h.store.index) > 0
    assert set(encoders) == {"mlx-fleet-disk"}  # envelopes made off the model thread
    h.assert_same(again, h.cold(prompt))


def test_restore_or_recompute_follows_the_predicted_costs(disk_harness):
    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    forget_ram(h)
    costs = h.pc.costs
    costs.ram_bps, costs.disk_bps = 1e9, 1e3  # a disk so slow that any prefill beats it
    costs.prefill_tps = lambda: 1e6
    cold_choice = h.warm(prompt)
    assert cold_choice.cached == 0 and costs.choices == {"restore": 0, "recompute": 1}
    costs.prefill_tps = lambda: 1.0  # a prefill so slow that any read beats it
    hit = h.warm(prompt)
    assert hit.cached > 0 and costs.choices == {"restore": 1, "recompute": 1}
    assert h.pc.stats()["costs"]["choices"] == costs.choices
    h.assert_same(cold_choice, h.cold(prompt))
    h.assert_same(hit, h.cold(prompt))


@pytest.mark.parametrize("few_launches", [False, True])  # the CPU's way (one copy per byte) and a GPU's
@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4"])
def test_both_ways_of_batching_copies_capture_and_restore_the_same_bits(harness, name, few_launches):
    h = harness(name)
    h.pc.few_launches = few_launches  # spans captured at once and runs concatenated first, or not
    h.warm(prompt_of(300), max_tokens=20)  # each 64-token chunk completes two 32-token blocks
    prompt = prompt_of(400)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached >= 256
    h.assert_same(warm, cold)
