"""Host arrays onto the device: on CUDA by the driver's DMA, elsewhere by mx.array; bitwise the same either way."""

import logging

import mlx.core as mx
import numpy as np
import pytest

from cluster.kernels import cuda_upload
from cluster.store.arrays import to_mlx

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the DMA path is CUDA's (elsewhere upload is mx.array)")


def hosts():
    """A block's kinds of arrays: bf16 bits, f32, f16, uint8 and int32, one of them not contiguous, one empty."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=(3, 1, 2, 64, 16), dtype=np.uint16)
    return [("bfloat16", bits), ("float32", rng.standard_normal((4, 64, 8), dtype=np.float32)),
            ("float16", rng.standard_normal((2, 5)).astype(np.float16)),
            ("uint8", rng.integers(0, 255, size=(7,), dtype=np.uint8)),
            ("int32", rng.integers(-9, 9, size=(6, 4), dtype=np.int32).T),  # a transposed view
            ("float32", np.zeros((0, 8), np.float32))]


def same(a: mx.array, b: mx.array) -> bool:
    """The same dtype, shape and bytes (random bf16 bits hold NaNs, which no comparison of values equates)."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and bytes(memoryview(a)) == bytes(memoryview(b))


def test_upload_gives_each_array_bitwise_with_its_dtype_and_shape():
    tagged = hosts()
    got = cuda_upload.upload(tagged)
    for (tag, data), out in zip(tagged, got):
        want = to_mlx((tag, np.ascontiguousarray(data)))
        assert (out.dtype, out.shape) == (getattr(mx, tag), data.shape)
        assert same(out, want)
    assert cuda_upload.upload([]) == []


def test_elsewhere_upload_is_mx_array():
    if ON_CUDA:
        assert cuda_upload.applies()
    else:
        assert not cuda_upload.applies()


@cuda_only
def test_on_cuda_the_bytes_go_by_the_drivers_copy(monkeypatch):
    copies = []
    real = cuda_upload._driver.copy
    monkeypatch.setattr(cuda_upload._driver, "copy", lambda dst, src, n: copies.append(n) or real(dst, src, n))
    tagged = hosts()
    got = cuda_upload.upload(tagged)
    assert copies == [d.nbytes for _, d in tagged if d.nbytes]
    assert all(same(o, to_mlx((t, np.ascontiguousarray(d)))) for (t, d), o in zip(tagged, got))


@cuda_only
def test_a_failing_driver_call_falls_back_to_managed_pages_for_good(monkeypatch, caplog):
    monkeypatch.setattr(cuda_upload._driver, "copy", lambda dst, src, n: 700)  # cudaErrorIllegalAddress: a fault
    monkeypatch.setattr(cuda_upload, "_disabled", False)
    tagged = hosts()
    with caplog.at_level(logging.WARNING, logger=cuda_upload.__name__):
        got = cuda_upload.upload(tagged)
    assert "cuMemcpyHtoD returned CUDA error 700" in caplog.text
    assert not cuda_upload.applies()
    assert all(same(o, to_mlx((t, np.ascontiguousarray(d)))) for (t, d), o in zip(tagged, got))


class Memory:
    """Stands in for the driver's page-locked allocations (the pool's logic is the same on any memory)."""

    def __init__(self, fail: bool = False):
        self.made: list[np.ndarray] = []
        self.fail = fail

    def __call__(self, nbytes: int) -> int:
        if self.fail:
            raise cuda_upload.DriverError("cuMemHostAlloc returned CUDA error 2")
        self.made.append(np.zeros(nbytes, np.uint8))
        return self.made[-1].ctypes.data


def test_a_read_buffer_is_reused_only_once_its_last_view_is_gone():
    memory = Memory()
    pool = cuda_upload.PinnedBuffers(1 << 20, memory)
    buf = pool.take(4096)
    assert buf.flags.writeable and buf.nbytes == 4096 and buf.ctypes.data == memory.made[0].ctypes.data
    view = buf[100:200]  # as a decoded block's arrays view its bytes
    del buf
    other = pool.take(4000)  # the first is still viewed: a second buffer (of the same grain)
    assert other.ctypes.data == memory.made[1].ctypes.data and other.nbytes == 4000
    del view
    again = pool.take(4100)  # a block file a few header bytes longer fits the first buffer again
    assert again.ctypes.data == memory.made[0].ctypes.data and again.nbytes == 4100
    assert [m.nbytes for m in memory.made] == [cuda_upload.GRAIN] * 2
    assert pool.stats() == {"budget_bytes": 1 << 20, "pinned_bytes": 2 * cuda_upload.GRAIN, "failed": False,
                            "pinned": 2, "reused": 1, "pageable": 0}


def test_past_its_budget_or_after_a_failure_a_read_gets_ordinary_memory(caplog):
    memory = Memory()
    pool = cuda_upload.PinnedBuffers(cuda_upload.GRAIN + 6000, memory)
    kept = [pool.take(4096), pool.take(4096)]  # the second would pass the budget
    assert len(memory.made) == 1 and kept[1].ctypes.data != memory.made[0].ctypes.data
    failing = cuda_upload.PinnedBuffers(1 << 20, Memory(fail=True))
    with caplog.at_level(logging.WARNING, logger=cuda_upload.__name__):
        got = [failing.take(100), failing.take(100)]
    assert [g.nbytes for g in got] == [100, 100] and caplog.text.count("page-locked memory") == 1
    assert failing.stats()["failed"] and failing.stats()["pinned_bytes"] == 0
    assert (pool.counters["pageable"], failing.counters["pageable"]) == (1, 2)


def test_elsewhere_there_is_no_pool():
    assert (cuda_upload.pinned_buffers(1 << 30) is None) == (not ON_CUDA)
    assert cuda_upload.pinned_buffers(0) is None
