"""Host arrays onto the device on MLX's CUDA backend, by the driver's DMA instead of page faults.

A block read from the disk or pulled from a peer arrives as numpy arrays and must become device arrays
before a restore can use it. On a Mac that is `mx.array(numpy)`, a copy within unified memory. On MLX's
CUDA backend every array is managed memory: `mx.array(numpy)` writes the bytes into fresh managed pages
from the host, and the first kernel that reads them makes the driver migrate them to the GPU page by
page. For the 1.13 GB of an 8k-token prompt of the 8B shape that took 0.5 s to write and 0.2-0.3 s to
migrate on an H100 (1.2-1.7 GB/s in all): as slow as the disk the blocks came from, so a disk hit cost
twice its read.

Here the destination arrays are made on the device first (a fill kernel, so their pages are the GPU's),
then each host array goes in with one `cuMemcpyHtoD` (the driver's DMA from pageable memory), then one
context synchronize: 0.15-0.18 s for the same 1.13 GB on the H100 (6-8 GB/s), bitwise the same arrays
(docs/gpu.md). MLX never sees the copy. That is safe because each destination is fresh and evaluated, no
other array shares its buffer, and nothing reads it before `upload` returns.

Elsewhere (Metal, the CPU) `upload` is `mx.array`, as before. The driver is reached through ctypes
(`libcuda.so.1`, present wherever MLX's CUDA backend runs). If it cannot be loaded, or a call fails,
`upload` falls back to `mx.array` for the rest of the process with one warning: slower, never wrong.

Reads bound for the device can land in page-locked host memory (`PinnedBuffers`): the driver's DMA from it
runs at the bus's speed rather than through a staging copy, and buffers reused by size are not faulted in
anew on every disk hit. A buffer goes back to its pool only when the last numpy view of it is gone, so a
block's bytes are never overwritten while anything still reads them.

`upload` runs on the model thread only, like all of a replica's MLX work; `PinnedBuffers.take` on the
threads that read block files (driver calls only, no MLX).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections import defaultdict
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from cluster.store.arrays import AS_BITS, to_mlx
from cluster.store.block_format import Tagged

log = logging.getLogger(__name__)

GRAIN = 64 << 10  # read buffers' sizes are multiples of this


class DriverError(RuntimeError):
    pass


class _Driver:
    """The few CUDA driver calls an upload needs."""

    def __init__(self, lib: ctypes.CDLL):
        self.copy = lib.cuMemcpyHtoD_v2
        self.copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.synchronize = lib.cuCtxSynchronize
        self.current = lib.cuCtxGetCurrent
        self.retain = lib.cuDevicePrimaryCtxRetain
        self.make_current = lib.cuCtxSetCurrent
        self.host_alloc = lib.cuMemHostAlloc
        self.host_alloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]

    def call(self, name: str, rc: int) -> None:
        if rc != 0:
            raise DriverError(f"{name} returned CUDA error {rc}")

    def pinned(self, nbytes: int) -> int:
        """The address of `nbytes` of fresh page-locked host memory (kept for the life of the process)."""
        self.bind()
        ptr = ctypes.c_void_p()
        self.call("cuMemHostAlloc", self.host_alloc(ctypes.byref(ptr), nbytes, 0))
        return ptr.value

    def bind(self) -> None:
        """MLX's context current on this thread (the runtime binds its primary context lazily per thread)."""
        ctx = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", self.current(ctypes.byref(ctx)))
        if not ctx.value:
            self.call("cuDevicePrimaryCtxRetain", self.retain(ctypes.byref(ctx), 0))
            self.call("cuCtxSetCurrent", self.make_current(ctx))


_driver: Optional[_Driver] = None
_disabled = False


def applies() -> bool:
    """MLX runs on its CUDA backend (managed memory) and the driver's calls are at hand."""
    global _driver, _disabled
    if _disabled:
        return False
    if _driver is None:
        backend = getattr(mx, "cuda", None)
        if mx.default_device().type != mx.DeviceType.gpu or backend is None or not backend.is_available():
            _disabled = True
            return False
        try:
            _driver = _Driver(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError) as e:
            log.warning("the CUDA driver is not at hand (%s): blocks move to the device through managed pages", e)
            _disabled = True
            return False
    return True


def upload(tagged: list[Tagged]) -> list[mx.array]:
    """Each (dtype tag, host array) as an evaluated device array with its bytes (model thread)."""
    global _disabled
    if not tagged or not applies():
        return [to_mlx(t) for t in tagged]
    try:
        return _dma(tagged)
    except DriverError as e:
        log.warning("copying blocks to the device by DMA failed (%s): managed pages from now on", e)
        _disabled = True
        return [to_mlx(t) for t in tagged]


def _dma(tagged: list[Tagged]) -> list[mx.array]:
    hosts = [np.ascontiguousarray(data) for _, data in tagged]
    dtypes = [getattr(mx, tag) for tag, _ in tagged]
    outs = [mx.zeros(h.shape, AS_BITS.get(d, d)) for d, h in zip(dtypes, hosts)]  # numpy holds bf16 as uint16
    mx.eval(outs)
    mx.synchronize()  # the fills are done before the copies land (the driver's stream is not MLX's)
    for (tag, _), out, host in zip(tagged, outs, hosts):
        if out.nbytes != host.nbytes:
            raise DriverError(f"a {tag} array of {host.nbytes} bytes got a device buffer of {out.nbytes}")
    _driver.bind()
    for out, host in zip(outs, hosts):
        if host.nbytes:
            _driver.call("cuMemcpyHtoD", _driver.copy(_address(out), host.ctypes.data, host.nbytes))
    _driver.call("cuCtxSynchronize", _driver.synchronize())
    return [out.view(d) if d in AS_BITS else out for d, out in zip(dtypes, outs)]


def _address(a: mx.array) -> int:
    """The device address of an evaluated array's buffer (managed memory: the host sees the same address)."""
    return np.frombuffer(memoryview(a), np.uint8).ctypes.data


class PinnedBuffers:
    """Page-locked host buffers for block files read for a device restore, reused by size.

    A process-wide pool (`pinned_buffers`): its budget is the page-locked memory it may hold, and past it a
    read gets ordinary memory. Buffers are kept for the life of the process once made, each size on a free
    list of its own (a model's blocks come in one or two sizes). `take` returns a numpy array over a buffer;
    the buffer returns to its list when the last array viewing it is collected, never before."""

    def __init__(self, budget: int, alloc: Optional[Callable[[int], int]] = None):
        """`alloc(nbytes)`: a new buffer's address (the driver's page-locked memory by default)."""
        self.budget = budget
        self.alloc = alloc or (lambda n: _driver.pinned(n))
        self.held = 0  # bytes of page-locked memory made
        self.free: dict[int, list[int]] = defaultdict(list)
        self.counters = {"pinned": 0, "reused": 0, "pageable": 0}
        self.failed = False
        self._lock = threading.Lock()

    def take(self, want: int) -> np.ndarray:
        """A writable uint8 array of `want` bytes (page-locked within the budget). Buffers come in sizes
        rounded up to GRAIN: one model's block files differ by a few header bytes."""
        nbytes = -(-want // GRAIN) * GRAIN
        with self._lock:
            free = self.free.get(nbytes)
            if free:
                address = free.pop()
                self.counters["reused"] += 1
            elif nbytes and not self.failed and self.held + nbytes <= self.budget:
                address, self.held = None, self.held + nbytes
            else:
                self.counters["pageable"] += 1
                return np.empty(want, np.uint8)
        if address is None:
            try:
                address = self.alloc(nbytes)
            except Exception as e:  # no page-locked memory to be had: ordinary memory, and no more tries
                log.warning("page-locked memory for disk reads failed (%s): reads use ordinary memory", e)
                with self._lock:
                    self.held -= nbytes
                    self.failed = True
                    self.counters["pageable"] += 1
                return np.empty(want, np.uint8)
            with self._lock:
                self.counters["pinned"] += 1
        owner = (ctypes.c_uint8 * nbytes).from_address(address)  # every view's base: when it goes, the buffer is free
        weakref.finalize(owner, self._give_back, nbytes, address)
        return np.frombuffer(owner, np.uint8)[:want]

    def _give_back(self, nbytes: int, address: int) -> None:
        with self._lock:
            self.free[nbytes].append(address)

    def stats(self) -> dict:
        with self._lock:
            return {"budget_bytes": self.budget, "pinned_bytes": self.held, "failed": self.failed, **self.counters}


_pool: Optional[PinnedBuffers] = None


def pinned_buffers(budget: int) -> Optional[PinnedBuffers]:
    """The process's pool of page-locked read buffers, its budget raised to at least `budget`; None where
    uploads do not use the driver (Metal, the CPU) or the budget is 0."""
    global _pool
    if budget <= 0 or not applies():
        return None
    if _pool is None:
        _pool = PinnedBuffers(budget)
    _pool.budget = max(_pool.budget, budget)
    return _pool
