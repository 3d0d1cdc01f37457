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

Model thread only, like all of a replica's MLX work.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import mlx.core as mx
import numpy as np

from cluster.store.arrays import to_mlx
from cluster.store.block_format import Tagged

log = logging.getLogger(__name__)

_BITS = {"bfloat16": mx.uint16}  # numpy has no bfloat16: its bytes travel as uint16 (store/arrays.py)


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

    def call(self, name: str, rc: int) -> None:
        if rc != 0:
            raise DriverError(f"{name} returned CUDA error {rc}")

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
    outs = [mx.zeros(h.shape, _BITS.get(tag) or getattr(mx, tag)) for (tag, _), h in zip(tagged, hosts)]
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
    return [out.view(getattr(mx, tag)) if tag in _BITS else out for (tag, _), out in zip(tagged, outs)]


def _address(a: mx.array) -> int:
    """The device address of an evaluated array's buffer (managed memory: the host sees the same address)."""
    return np.frombuffer(memoryview(a), np.uint8).ctypes.data
