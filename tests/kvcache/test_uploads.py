"""A disk hit's blocks move to the device in batches while the rest is read (cluster/kvcache/uploads.py): in
order, on the model thread, into the RAM tier, and a cached run still answers as a cold one."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from cluster.engine import model_thread
from cluster.engine.scheduler import Scheduler
from cluster.kvcache import device_blocks, uploads
from cluster.kvcache.admission import Admission
from cluster.kvcache.device_blocks import DeviceBlock
from cluster.kvcache.session import BlockSession
from cluster.store import block_format
from cluster.store.hashing import chain_ids
from tests.kvcache.conftest import forget_ram, prompt_of


def on_disk(disk_harness, n: int = 300):
    h = disk_harness("tiny-dense")
    prompt = prompt_of(n)
    h.warm(prompt, max_tokens=2)
    forget_ram(h)
    return h, prompt


def record(h, monkeypatch) -> list:
    """Events in order: ("read", block index) as each block read arrives and is decoded, ("move", indexes,
    thread name) as a batch moves to the device."""
    events, decode, from_host = [], h.pc.decode, device_blocks.from_host
    ids = {}

    def decoded(data, kind, j, chain, payload_verified=False):
        block = decode(data, kind, j, chain, payload_verified=payload_verified)
        ids[block.id] = j
        events.append(("read", j))
        return block

    def moved(blocks, runs):
        events.append(("move", [ids[b.id] for b in blocks], threading.current_thread().name))
        return from_host(blocks, runs)

    monkeypatch.setattr(h.pc, "decode", decoded)
    monkeypatch.setattr(device_blocks, "from_host", moved)
    return events


def test_blocks_move_in_batches_as_they_are_read_and_the_hit_is_cold_exact(disk_harness, monkeypatch):
    h, prompt = on_disk(disk_harness)
    monkeypatch.setattr(uploads, "UPLOAD_BYTES", 2 * h.pc.block_bytes)  # two blocks a batch
    events = record(h, monkeypatch)
    prefetch = Admission(h.pc).fetch(prompt)
    m = -(-prefetch.n // h.B)
    # The CPU's schedule resumes at a block (299 of 300 tokens: 9 blocks, the last batch one block), a GPU's at a
    # chunk's cut (256 tokens: 8 blocks, whole pairs).
    assert prefetch.n > 0 and prefetch.from_disk == m == (9 if h.pc.schedule.mode == "block" else 8)
    me = threading.current_thread().name  # the admission ran on the model thread's (the main) thread: at once
    want = []
    for j in range(m):
        want.append(("read", j))
        if j % 2 == 1:
            want.append(("move", [j - 1, j], me))
    if m % 2:
        want.append(("move", [m - 1], me))  # what is left after the last read
    assert events == want
    ids = chain_ids(h.pc.namespace, prompt, h.B)[:m]
    assert all(isinstance(prefetch.blocks[k], DeviceBlock) for k in ids)
    assert h.pc.tiers.ram.present(ids) == [True] * m  # moved into RAM before the restore: the next hit is there
    warm = h._run(prompt, 12, BlockSession(h.pc, list(prompt), prefetch))
    assert warm.cached == prefetch.n and [e for e in events if e[0] == "move"][-1] == want[-1]  # no move since
    h.assert_same(warm, h.cold(prompt))


def test_from_an_admission_thread_the_moves_run_on_the_model_thread(disk_harness, monkeypatch):
    """As in a replica: the admission reads on its own thread and hands each batch to the scheduler; with the
    thread guard on, MLX work anywhere else would raise."""
    h, prompt = on_disk(disk_harness)
    monkeypatch.setattr(uploads, "UPLOAD_BYTES", 3 * h.pc.block_bytes)
    s = Scheduler(name="mlx-fleet-test")
    try:
        cold = s.run(lambda: h.cold(prompt))
        events = record(h, monkeypatch)
        h.pc.device_work = s.future
        with ThreadPoolExecutor(1, thread_name_prefix="mlx-fleet-admit") as pool:
            prefetch = pool.submit(Admission(h.pc).fetch, prompt).result()
        m = -(-prefetch.n // h.B)
        moves = [e for e in events if e[0] == "move"]
        assert prefetch.n > 0 and [j for e in moves for j in e[1]] == list(range(m))
        assert [len(e[1]) for e in moves] == [3] * (m // 3) + ([m % 3] if m % 3 else [])
        assert {e[2] for e in moves} == {"mlx-fleet-test"}
        warm = s.run(lambda: h._run(prompt, 12, BlockSession(h.pc, list(prompt), prefetch)))
        assert len([e for e in events if e[0] == "move"]) == len(moves)  # the restore moved nothing more
        s.run(lambda: h.assert_same(warm, cold))
    finally:
        s.stop()


def test_a_batch_that_fails_to_move_is_moved_by_the_restore(disk_harness, monkeypatch):
    h, prompt = on_disk(disk_harness)
    calls, real = [], device_blocks.from_host

    def flaky(blocks, runs):
        calls.append(len(blocks))
        if len(calls) == 1:
            raise RuntimeError("out of device memory")
        return real(blocks, runs)

    monkeypatch.setattr(device_blocks, "from_host", flaky)
    prefetch = Admission(h.pc).fetch(prompt)
    m = -(-prefetch.n // h.B)
    assert prefetch.n > 0 and calls == [m]  # one batch (these blocks are far under UPLOAD_BYTES), failed
    assert not any(isinstance(b, DeviceBlock) for b in prefetch.blocks.values())
    warm = h._run(prompt, 12, BlockSession(h.pc, list(prompt), prefetch))
    assert warm.cached == prefetch.n and calls == [m, m]  # the restore moved them
    h.assert_same(warm, h.cold(prompt))


def test_the_way_to_the_model_thread_depends_on_the_calling_thread():
    queue = object()
    assert uploads.submitter(queue) is uploads.inline  # the main thread, no model thread claimed: a script
    s = Scheduler(name="mlx-fleet-test")
    try:
        assert s.run(lambda: uploads.submitter(queue)) is uploads.inline  # on the model thread itself
        assert uploads.submitter(queue) is queue  # elsewhere, with a model thread: its queue
        assert uploads.submitter(None) is None  # or none: the restore moves the blocks
    finally:
        s.stop()
    with ThreadPoolExecutor(1) as pool:  # another thread of a script: never MLX off its main thread
        assert pool.submit(uploads.submitter, None).result() is None


def test_inline_runs_at_once_and_keeps_the_exception_for_result():
    assert uploads.inline(lambda: 7).result() == 7
    failed = uploads.inline(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()


def test_a_batchs_read_buffers_go_back_to_the_pool_once_it_is_moved(disk_harness, monkeypatch):
    """Not after the last read: a 32k-token prompt of an 8B model would otherwise hold all 4.8 GB of host bytes
    (and overflow the page-locked pool) beside their device copies."""
    from cluster.kernels import cuda_upload
    from tests.kernels.test_cuda_upload import Memory

    h, prompt = on_disk(disk_harness)
    pool = h.pc.tiers.disk.buffers = cuda_upload.PinnedBuffers(1 << 30, Memory())
    monkeypatch.setattr(uploads, "UPLOAD_BYTES", 2 * h.pc.block_bytes)
    back, give_back = [], pool._give_back
    monkeypatch.setattr(pool, "_give_back", lambda *a: (back.append(1), give_back(*a)))
    returned_at_moves, from_host = [], device_blocks.from_host
    monkeypatch.setattr(device_blocks, "from_host",
                        lambda blocks, runs: returned_at_moves.append(len(back)) or from_host(blocks, runs))
    prefetch = Admission(h.pc).fetch(prompt)
    m = -(-prefetch.n // h.B)
    assert prefetch.from_disk == m == (9 if h.pc.schedule.mode == "block" else 8)  # as above
    assert len(returned_at_moves) == -(-m // 2)  # two blocks a batch, the rest last: 5 (4 on a GPU)
    assert pool.counters["pinned"] + pool.counters["reused"] == m
    # Before the k-th move, every block of the batches before it went back, but the one the read loop still
    # holds (the last read's, until the next arrives).
    assert all(got >= 2 * k - 1 for k, got in enumerate(returned_at_moves)), returned_at_moves
    assert len(back) == m  # all of them, before the restore
    warm = h._run(prompt, 12, BlockSession(h.pc, list(prompt), prefetch))
    h.assert_same(warm, h.cold(prompt))


def test_a_block_refused_as_it_arrives_is_a_miss_and_the_rest_still_moves(disk_harness, monkeypatch):
    h, prompt = on_disk(disk_harness)
    monkeypatch.setattr(uploads, "UPLOAD_BYTES", 2 * h.pc.block_bytes)
    decode, bad = h.pc.decode, 4

    def decoded(data, kind, j, chain, payload_verified=False):
        if j == bad:
            raise block_format.WrongBlock("block is not the one stored under this key")
        return decode(data, kind, j, chain, payload_verified=payload_verified)

    monkeypatch.setattr(h.pc, "decode", decoded)
    prefetch = Admission(h.pc).fetch(prompt)
    monkeypatch.undo()
    assert 0 < prefetch.n <= bad * h.B  # the plan shrank to before the refused block
    ids = chain_ids(h.pc.namespace, prompt, h.B)
    assert all(isinstance(prefetch.blocks[k], DeviceBlock) for k in ids[:-(-prefetch.n // h.B)])
    assert {k: v for k, v in h.pc.counters.as_dict()["corrupt"].items() if v} == {"id": 1}  # WrongBlock's reason
    warm = h._run(prompt, 12, BlockSession(h.pc, list(prompt), prefetch))
    h.assert_same(warm, h.cold(prompt))


def test_moves_the_model_thread_never_runs_are_left_to_the_restore(disk_harness, monkeypatch):
    """A stopped (or stuck) model thread: the admission waits WAIT_S in all, cancels what did not begin, and the
    restore moves those blocks itself."""
    h, prompt = on_disk(disk_harness)
    monkeypatch.setattr(uploads, "WAIT_S", 0.2)
    s = Scheduler(name="mlx-fleet-test")
    s.stop()
    assert isinstance(s.future(lambda: 1).exception(), RuntimeError)  # a stopped scheduler runs nothing
    never = []
    h.pc.device_work = lambda fn: never.append(Future()) or never[-1]
    claimed, release = threading.Event(), threading.Event()

    def model():  # a replica's model thread, busy elsewhere: the admission must go through device_work
        model_thread.claim()
        claimed.set()
        release.wait()
        model_thread.release()

    keep = threading.Thread(target=model, daemon=True)
    keep.start()
    claimed.wait()
    with ThreadPoolExecutor(1, thread_name_prefix="mlx-fleet-admit") as pool:
        try:
            t0 = time.monotonic()
            prefetch = pool.submit(Admission(h.pc).fetch, prompt).result()
            waited = time.monotonic() - t0
        finally:
            release.set()
            keep.join()
    assert prefetch.n > 0 and len(never) == 1 and never[0].cancelled() and waited < 5
    assert not any(isinstance(b, DeviceBlock) for b in prefetch.blocks.values())
    warm = h._run(prompt, 12, BlockSession(h.pc, list(prompt), prefetch))  # the restore moves them
    assert warm.cached == prefetch.n
    h.assert_same(warm, h.cold(prompt))
