"""Batch-invariant decode (`deterministic: true`): a batched row's logits are bitwise the same request's alone.

Why batched rows differ: kernels are chosen by shape, and their orders of summation with them.
- On a GPU a matmul's kernel depends on the number of rows: one decoding sequence is a gemv, eight
  a GEMM with other tiles (cuBLASLt per shape; `quantized_matmul` by rows). The CPU's kernels
  compute each row alone, in order, whatever the rows beside it (measured for float32, bfloat16
  and 4-bit weights at 1-32 rows).
- Attention over a batched cache sums each row's keys in their place in the left-padded buffer.
  On a GPU the row's padding and the buffer's length (the longest row's) change how its keys are
  split between threads. On every backend a sliding window's ring is laid out otherwise in a batch
  than alone, so even the CPU sums a windowed row's keys in another order (tiny-swa and
  tiny-gemma4 part from their solo logits by ulps in float32 there).

What the mode does, during a decode step only (prefill is per sequence anyway, batch.py):
- Attention runs over each row's own keys in temporal order (invariant_attention.py): in a kernel
  whose every split is a function of the key's logical index, on CUDA; elsewhere per row in MLX ops
  (`reference_attention`, slower: it reads the rows' lengths back every layer).
- On a GPU every matmul runs at one row count, the replica's `decode_concurrency`: an input with
  fewer rows is padded with zero rows and the result sliced back (`Linear`, `QuantizedLinear`, a
  tied head's `as_linear`, `Conv1d`). A row's result then depends on its own inputs alone.

`mlx-fleet bench batch --deterministic` measures the cost against the default. Metal is refused at
start for now: the kernel exists in CUDA only, and the mode's promise is not yet measured on a Mac.

All of it is opt-in per replica: the modules' classes are swapped at load (`prepare`); they pad
and route attention only inside `decoding()`, on the model thread that entered it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from cluster.engine.invariant_attention import attention, batched, rows_of, supports

_state = threading.local()


class DeterministicUnsupported(ValueError):
    """The backend has no batch-invariant decode."""


def pads_rows() -> bool:
    """Whether this backend's matmuls need the fixed row count (a GPU's do; the CPU's compute each row alone).

    Raises DeterministicUnsupported on Metal."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return False
    if mx.cuda.is_available():
        return True
    raise DeterministicUnsupported(
        "deterministic: batch-invariant decode is not available on Metal yet (its attention kernel is CUDA's); "
        "on this Mac set deterministic: false (the default: batched answers then agree with solo ones as "
        "docs/gpu.md measures), or batching: false, where every sequence decodes alone")


def prepare(model: nn.Module) -> None:
    """Swap the model's matmul modules for row-padding ones and route decode attention to the kernel.

    Idempotent; the model computes as before outside `decoding()`."""
    for _, module in model.named_modules():
        padded = _PADDED.get(type(module))
        if padded is not None:
            module.__class__ = padded
    _patch_attention()


# -- exact decode attention (the default on CUDA) ------------------------------------------------
_one_query = False  # route one-query forwards' attention to the kernel (exact_decode_attention)


def exact_decode_attention(on: bool = True) -> None:
    """Route the attention of every one-query forward (a decode step, a prompt's last token, which the engine
    runs alone, and a one-token prefill chunk) to the kernel, inside `one_query()`, where the kernel takes the
    shapes (head dims up to 512, Gemma 4's global layers included).

    The default on MLX's CUDA backend (models/loading.py), because there MLX sends such a step to cuDNN once
    256 keys are held in a KV cache's buffer (a slice of a buffer of 256 * k tokens, as mlx-lm's caches
    grow), and cuDNN's decode does not repeat itself bit for bit: in bf16 a cold run parted from itself by
    a ulp at the step that reached 256 keys, in one process, while MLX's vector kernel and plain ops
    repeated (docs/gpu.md, the twelfth session). A cached answer can only be bitwise the cold one where the
    cold one is bitwise itself. The kernel's sums follow the keys' logical order alone, so a row's result is
    also the same whatever its buffer's capacity or its window's rotation."""
    global _one_query
    _one_query = on
    if on:
        _patch_attention()


# In the cache fingerprint where it is in effect. /2: the warps' outputs merge through one G x D buffer (the
# same sums in the same order as /1's NW copies, but no bitwise proof of it was run on a GPU). /3: head dims up
# to 512, so Gemma 4's global layers take the kernel too, where /2 left them to MLX's attention (cuDNN).
EXACT_DECODE_VERSION = "invariant-decode-attention/3"


def routes_one_query() -> bool:
    return _one_query


@contextmanager
def one_query():
    """A forward of one query per row: inside it, attention goes to the kernel where `exact_decode_attention`
    is on (a no-op otherwise, and inside a `decoding()` step, which routes already)."""
    if not _one_query or _on():
        yield
        return
    with decoding(0):
        yield


@contextmanager
def decoding(rows: int = 0):
    """One batched decode step on this thread: attention over each row's own keys; matmuls at `rows`
    rows (0: as they come)."""
    _state.on, _state.rows, _state.kv = True, rows, {}
    try:
        yield
    finally:
        _state.on, _state.rows, _state.kv = False, 0, {}


def _rows() -> int:
    return getattr(_state, "rows", 0)


def _on() -> bool:
    return getattr(_state, "on", False)


# -- matmuls at one row count -------------------------------------------------------------------
def _pad_rows(x: mx.array, fn) -> mx.array:
    """fn(x) computed at the step's fixed row count: x's rows padded with zeros, the result sliced back."""
    rows, want = 1, _rows()
    for d in x.shape[:-1]:
        rows *= d
    if not want or rows == want:
        return fn(x)
    if rows > want:
        raise RuntimeError(f"a decode step of {rows} rows is over the fixed {want}")
    out = fn(mx.pad(x.reshape(rows, x.shape[-1]), [(0, want - rows), (0, 0)]))[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _RowsLinear(nn.Linear):
    def __call__(self, x):
        return _pad_rows(x, super().__call__)


class _RowsQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        return _pad_rows(x, super().__call__)


class _RowsEmbedding(nn.Embedding):
    def as_linear(self, x):
        return _pad_rows(x, super().as_linear)


class _RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        return _pad_rows(x, super().as_linear)


class _RowsConv1d(nn.Conv1d):
    """A conv over [B, L, C]: the batch is padded, not the rows (its kernel is chosen by B)."""

    def __call__(self, x):
        want = _rows()
        if not want or x.shape[0] == want:
            return super().__call__(x)
        if x.shape[0] > want:
            raise RuntimeError(f"a decode step of {x.shape[0]} rows is over the fixed {want}")
        pad = [(0, want - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        return super().__call__(mx.pad(x, pad))[: x.shape[0]]


_PADDED = {nn.Linear: _RowsLinear, nn.QuantizedLinear: _RowsQuantizedLinear, nn.Embedding: _RowsEmbedding,
           nn.QuantizedEmbedding: _RowsQuantizedEmbedding, nn.Conv1d: _RowsConv1d}


# -- attention --------------------------------------------------------------------------------
def _patch_attention() -> None:
    """Route mlx-lm's attention to the kernel during `decoding()` (every loaded model module's reference)."""
    import sys

    from mlx_lm.models import base

    original = getattr(base.scaled_dot_product_attention, "_mlx_fleet_original", base.scaled_dot_product_attention)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if _on() and queries.shape[2] == 1 and sinks is None and supports(queries, keys, values):
            kv = _state.kv
            geometry = rows_of(cache, keys) if cache is not None else kv.get(id(keys), (None, None))[1]
            if geometry is not None and isinstance(mask, mx.array) and (
                    mask.dtype != mx.bool_ or cache is not None and not batched(cache)):
                # The kernel masks by each row's count alone: a batch's padding mask (boolean) says no more; an
                # additive mask (MLA models pass score terms in it) or one sequence's mask array would say more.
                geometry = None
            if geometry is not None:
                kv[id(keys)] = (keys, geometry)  # a KV-shared layer (gemma4) passes these keys on, without a cache
                return attention(queries, keys, values, scale, *geometry)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._mlx_fleet_original = original
    for name, module in list(sys.modules.items()):
        if (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models.")) and \
                getattr(module, "scaled_dot_product_attention", None) in (original, base.scaled_dot_product_attention):
            module.scaled_dot_product_attention = scaled_dot_product_attention
