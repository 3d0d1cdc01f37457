"""The device RAM tier's invariants: a RAM hit makes no host copy and no check, a spill never blocks
the model thread, and the restore-or-recompute choice follows the predicted costs."""

import threading
import time

import pytest

from cluster.kernels import cuda_upload
from cluster.kvcache import device_blocks
from cluster.kvcache.admission import Admission
from cluster.kvcache.costs import MIN_BYTES
from cluster.store.hashing import chain_ids
from cluster.store import arrays, block_format
from tests.kvcache.conftest import forget_ram, prompt_of, ram_blocks


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
    for module, fn in ((device_blocks, "host_views"), (cuda_upload, "upload"), (device_blocks, "from_host"),
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
    monkeypatch.setattr(device_blocks, "from_host",
                        lambda blocks, runs: moved.extend(b.id for b in blocks) or real(blocks, runs))
    first, second = h.warm(prompt), h.warm(prompt)
    # The first from the disk (to its last kept block), the second from RAM (on the canonical schedule the
    # first run kept the prompt's tail again, so the second restores all but the last token).
    assert second.cached == (len(prompt) - 1 if h.pc.tails else first.cached) and first.cached > 0
    assert h.pc.tiers.disk.counters["disk_hits"] == len(moved)
    assert len(moved) == len(set(moved)) == -(-first.cached // h.B)  # the second hit was all in RAM
    h.assert_same(second, h.cold(prompt))


def test_a_disk_hit_hashes_each_payload_once(disk_harness, monkeypatch):
    """The disk read verifies each block's payload checksum (block_files.read_verified); decoding the same
    buffer then checks the header and the layout, but does not hash the payload again."""
    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    forget_ram(h)
    verified, real = [], h.pc.decode
    monkeypatch.setattr(h.pc, "decode", lambda *a, payload_verified=False: verified.append(payload_verified)
                        or real(*a, payload_verified=payload_verified))
    warm = h.warm(prompt)
    monkeypatch.undo()
    assert warm.cached > 0 and verified == [True] * h.pc.tiers.disk.counters["disk_hits"]
    h.assert_same(warm, h.cold(prompt))


def test_a_disk_hit_reads_into_the_pools_buffers_and_lets_them_all_go(disk_harness):
    """On CUDA reads land in page-locked buffers (kernels/cuda_upload.py); once the restore has moved them to
    the device none is held, so the next disk hit reuses every one. Any memory shows the pool's logic."""
    from tests.kernels.test_cuda_upload import Memory

    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    pool = h.pc.tiers.disk.buffers = cuda_upload.PinnedBuffers(1 << 30, Memory())
    forget_ram(h)
    first = h.warm(prompt)
    read = h.pc.tiers.disk.counters["disk_hits"]
    assert first.cached > 0 and pool.counters == {"pinned": read, "reused": 0, "pageable": 0}
    assert sum(len(free) for free in pool.free.values()) == read  # all back: nothing holds a read buffer
    forget_ram(h)
    again = h.warm(prompt)
    assert again.cached == first.cached and pool.counters["reused"] == read
    h.assert_same(again, h.cold(prompt))


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


def on_disk_only(h, prompt, disk_bps: float, write_bps: float = 0.0):
    """The prompt's blocks on the disk alone, and the replica's speeds: a fast RAM, a very fast prefill, and
    the disk's read and write speeds given (a read speed as if measured just now)."""
    h.warm(prompt, max_tokens=2)
    forget_ram(h)
    costs = h.pc.costs
    costs.ram_bps, costs.disk_bps, costs.write_bps = 1e9, disk_bps, write_bps
    costs.read_at = time.monotonic() if disk_bps else 0.0
    costs.prefill_tps = lambda: 1e6
    return costs


def test_restore_or_recompute_follows_the_predicted_costs(disk_harness):
    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    costs = on_disk_only(h, prompt, disk_bps=1e3)  # a disk so slow that any prefill beats it
    cold_choice = h.warm(prompt)
    assert cold_choice.cached == 0 and costs.choices == {"restore": 0, "recompute": 1}
    costs.prefill_tps = lambda: 1.0  # a prefill so slow that any read beats it
    hit = h.warm(prompt)
    assert hit.cached > 0 and costs.choices == {"restore": 1, "recompute": 1}
    assert h.pc.stats()["costs"]["choices"] == costs.choices
    h.assert_same(cold_choice, h.cold(prompt))
    h.assert_same(hit, h.cold(prompt))


def test_a_recompute_chosen_on_the_write_speed_measures_the_read_off_the_requests_path(disk_harness):
    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    costs = on_disk_only(h, prompt, disk_bps=0.0, write_bps=1e3)  # no read yet; writes so slow any prefill wins
    reads, real_read = [], h.pc.tiers.disk.get_many
    h.pc.tiers.disk.get_many = lambda keys, **kw: reads.append((threading.current_thread().name, len(keys))) or \
        real_read(keys, **kw)
    admission = Admission(h.pc)
    cold_choice = admission.fetch(prompt)
    assert cold_choice.n == 0 and costs.choices == {"restore": 0, "recompute": 1}
    with admission._sampling:  # the sample read has ended
        pass
    assert [t for t, _ in reads] == ["mlx-fleet-disk-sample"] and costs.disk_bps > 1e3 and not costs.read_worth_sampling()
    costs.prefill_tps = lambda: 1e3  # the measured read decides now: against a slow prefill, restore
    hit = admission.fetch(prompt)
    assert hit.n > 0 and costs.choices == {"restore": 1, "recompute": 1}
    assert [t for t, _ in reads] == ["mlx-fleet-disk-sample", threading.current_thread().name]
    assert reads[0][1] == reads[1][1]  # the whole plan, under SAMPLE_BYTES


def test_a_read_speed_gone_stale_is_measured_again_by_the_next_recompute(disk_harness):
    from cluster.kvcache import costs as costs_module

    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    costs = on_disk_only(h, prompt, disk_bps=1e3)  # measured on a busy disk: every disk plan loses to a recompute
    reads, real_read = [], h.pc.tiers.disk.get_many
    h.pc.tiers.disk.get_many = lambda keys, **kw: reads.append(kw) or real_read(keys, **kw)
    admission = Admission(h.pc)
    assert admission.fetch(prompt).n == 0 and reads == []  # recent: trusted
    costs.read_at -= costs_module.RESAMPLE_S + 1
    assert costs.read_worth_sampling()
    assert admission.fetch(prompt).n == 0 and costs.choices == {"restore": 0, "recompute": 2}
    with admission._sampling:
        pass
    assert [sorted(kw) for kw in reads] == [["arrived", "sample", "timing"]] and reads[0]["sample"] is True
    assert reads[0]["arrived"] is None and reads[0]["timing"]["read_s"] > 0  # no moves: a sample lets its bytes go
    assert costs.disk_bps > 1e3 and not costs.read_worth_sampling()
    costs.prefill_tps = lambda: 1e3  # against a slow prefill the re-measured disk restores
    assert admission.fetch(prompt).n > 0 and costs.choices == {"restore": 1, "recompute": 2}


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


def spill_idle(h) -> None:
    """What a replica's scheduler does while no sequence is in flight, until the backlog is out."""
    while h.pc.spill_idle():
        h.pc.tiers.disk.flush(30)
    assert h.pc.tiers.disk.flush(30)


def test_spills_wait_for_the_model_thread_to_be_idle(disk_harness):
    h = disk_harness("tiny-dense")
    h.pc.spill_when_idle = True  # as a replica sets it (its scheduler calls spill_idle while idle)
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    disk, held = h.pc.tiers.disk, ram_blocks(h)
    assert disk.flush(30) and disk.counters["spilled"] == 0 and h.pc.backlog()["blocks"] == len(held) > 0
    spill_idle(h)
    assert disk.counters["spilled"] == len(h.store.index) == len(held) and h.pc.backlog()["blocks"] == 0
    for key in held:
        assert h.store.path(h.pc.namespace, key).read_bytes() == bytes(h.pc.envelope(key))


def test_under_sustained_load_a_spill_waits_no_longer_than_its_delay(disk_harness, monkeypatch):
    from cluster.kvcache import spill

    monkeypatch.setattr(spill, "SPILL_DELAY_S", -1.0)  # every block overdue at the next seal
    h = disk_harness("tiny-dense")
    h.pc.spill_when_idle = True
    h.warm(prompt_of(300), max_tokens=2)
    assert h.pc.tiers.disk.flush(30) and h.pc.tiers.disk.counters["spilled"] == len(ram_blocks(h)) > 0
    assert h.pc.backlog()["blocks"] == 0


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-gemma4"])
def test_a_run_too_big_to_index_is_concatenated_in_groups_of_members_with_the_same_bits(harness, name, monkeypatch):
    """MLX's CUDA kernels index with 32-bit integers: an 8B model's run over 32k tokens (2.4e9 elements) was
    read out of bounds on the H200. Here the limit is shrunk so the tiny models' runs split too."""
    from cluster.kvcache import prefix_cache

    h = harness(name)
    h.pc.few_launches = True
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    run = h.pc.tiers.ram.get(chain_ids(h.pc.namespace, prompt, h.B)[0]).runs[0]
    monkeypatch.setattr(prefix_cache, "MAX_ELEMENTS", 3 * run[0].size * (300 // h.B))  # groups of 3 members
    assert run.shape[0] > 3
    warm = h.warm(prompt)
    assert warm.cached == h.hit_after(300, 300, 302)
    h.assert_same(warm, h.cold(prompt))


def test_a_restore_of_blocks_read_in_measures_their_move_to_the_device(disk_harness):
    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    h.warm(prompt, max_tokens=2)  # from RAM: device blocks, nothing moved
    costs = h.pc.costs
    assert costs.ram_bps > 0 and costs.move_bps == 0.0
    forget_ram(h)
    assert h.warm(prompt, max_tokens=2).cached > 0  # read from the disk, moved to the device
    assert costs.move_bps > 0 and costs.disk_bps > 0


def test_overdue_spills_wait_for_room_in_the_disk_queue_rather_than_drop_blocks(disk_harness, monkeypatch):
    """Sustained load with a disk slower than capture (a 32k prompt on the H200 dropped 4 of 444): overdue
    blocks go only as far as the queue has room, so none is dropped; the rest wait in the backlog."""
    from cluster.kvcache import spill

    monkeypatch.setattr(spill, "SPILL_DELAY_S", -1.0)
    h = disk_harness("tiny-dense")
    h.pc.spill_when_idle = True
    disk = h.pc.tiers.disk
    disk.queue_bytes = h.pc.block_bytes  # room for one block at a time; each forward completes two
    h.warm(prompt_of(300), max_tokens=2)
    assert disk.flush(30) and disk.counters["dropped_spills"] == 0
    assert disk.counters["spilled"] + h.pc.backlog()["blocks"] == len(ram_blocks(h))
    spill_idle(h)
    assert disk.counters["dropped_spills"] == 0 and len(h.store.index) == len(ram_blocks(h))


def test_the_backlog_holds_only_blocks_ram_holds(disk_harness):
    """A block the RAM tier lets go spills at once, so the backlog never keeps memory past the tier's budget."""
    h = disk_harness("tiny-dense")
    h.pc.tiers.ram.budget = 4 * h.pc.block_bytes  # room for 4 of the prompt's 9 blocks
    h.pc.spill_when_idle = True
    h.warm(prompt_of(300), max_tokens=2)
    disk, ram = h.pc.tiers.disk, h.pc.tiers.ram
    assert ram.evictions > 0 and disk.flush(30) and disk.counters["spilled"] == ram.evictions
    assert set(h.pc.spiller.pending) == set(ram_blocks(h))
    spill_idle(h)
    assert len(h.store.index) == ram.evictions + len(ram_blocks(h))


def test_a_spill_from_a_device_copy_writes_the_same_envelopes(disk_harness):
    """CUDA's way (the host reads a copy, so the RAM tier's pages stay on the GPU), run here on the CPU."""
    h = disk_harness("tiny-hybrid")
    h.pc.spiller.stage = True
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    assert h.pc.tiers.disk.flush(30) and len(h.store.index) > 0
    for key in ram_blocks(h):
        assert h.store.path(h.pc.namespace, key).read_bytes() == bytes(h.pc.envelope(key))
    h.assert_same(h.warm(prompt), h.cold(prompt))


def test_a_sample_read_takes_the_plans_first_blocks_up_to_its_bytes_and_is_no_hit(disk_harness, monkeypatch):
    from cluster.kvcache import admission as admission_module

    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    costs = on_disk_only(h, prompt, disk_bps=0.0, write_bps=1e3)
    few = -(-MIN_BYTES // h.pc.block_bytes)  # the fewest blocks whose read is measured
    monkeypatch.setattr(admission_module, "SAMPLE_BYTES", few * h.pc.block_bytes)
    reads, real_read = [], h.pc.tiers.disk.get_many
    h.pc.tiers.disk.get_many = lambda keys, **kw: reads.append((list(keys), kw)) or real_read(keys, **kw)
    admission = Admission(h.pc)
    hits = h.pc.tiers.disk.counters["disk_hits"]
    assert admission.fetch(prompt).n == 0 and costs.choices == {"restore": 0, "recompute": 1}
    with admission._sampling:
        pass
    assert [(keys, kw["sample"], kw["arrived"]) for keys, kw in reads] == \
        [(chain_ids(h.pc.namespace, prompt, h.B)[:few], True, None)]
    assert costs.disk_bps > 0 and h.pc.tiers.disk.counters["disk_hits"] == hits  # measured; not a hit


def test_a_plan_too_small_to_measure_is_not_sampled(disk_harness, monkeypatch):
    from cluster.kvcache import admission as admission_module

    h = disk_harness("tiny-dense")
    prompt = prompt_of(300)
    costs = on_disk_only(h, prompt, disk_bps=0.0, write_bps=1e3)
    monkeypatch.setattr(admission_module, "MIN_BYTES", 1 << 40)  # no plan here reaches it
    reads, real_read = [], h.pc.tiers.disk.get_many
    h.pc.tiers.disk.get_many = lambda keys, **kw: reads.append(keys) or real_read(keys, **kw)
    admission = Admission(h.pc)
    assert admission.fetch(prompt).n == 0 and costs.choices == {"restore": 0, "recompute": 1}
    with admission._sampling:
        pass
    assert reads == [] and costs.read_worth_sampling()
