"""Cut mlx-lm caches into per-block arrays and build caches back, per layer kind.

Dispatch is on the spec's type (CAPTURE / RESTORE tables), never on the model.

What a KV block holds, per cache entry:
  full       K, V of the block's B tokens                     [1, H, B, D] each
  quantized  K and V as (packed, scales, biases), B tokens     6 arrays
  sliding    K, V of the block's last min(B, W) tokens         (enough to rebuild any window)
  recurrent  nothing: recurrent state lives in checkpoint entries instead
A checkpoint entry holds, per recurrent entry, its arrays at exactly the block end.

Restoring at position n:
  full/quantized: the first n tokens of the concatenated blocks, in a buffer
                  of the capacity the schedule names (a cold cache's at n on the
                  canonical schedule, so the same attention kernels run);
  sliding:        the last min(n, W) tokens in temporal order, offset = n
                  (absolute: RoPE depends on it), _idx = len;
  recurrent:      the checkpoint taken at exactly n.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from cluster.families.specs import FullAttention, LayerSpec, QuantizedAttention, Recurrent, SlidingWindow


# Payload codecs and their versions. A version bump means blocks made by the old
# code must not be read by the new: the descriptor is part of the fingerprint
# (so the namespace changes) and of every block header (so a block is refused
# if it disagrees).
# tq*: 3 = int8 mean, log-coded uint8 row scales, and the bits that saves spent on bits+1 for some coordinates;
#      2 = centred on each block's mean row, norm-preserving float16 scales; 1 = plain norms in float32.
CODEC_VERSIONS = {"native": 1, "q8": 1, "q4": 1, "tq8": 3, "tq4": 3, "tq3": 3, "tq2": 3}
CODEC_BITS = {"native": None, "q8": 8, "q4": 4, "tq8": 8, "tq4": 4, "tq3": 3, "tq2": 2}
AFFINE = ("q8", "q4")  # mlx's QuantizedKVCache: the model itself runs quantized


def codec_descriptor(name: str, group_size: int) -> list:
    """[name, version, bits, group] of a payload codec: what the fingerprint and block headers carry."""
    bits = CODEC_BITS[name]
    return [name, CODEC_VERSIONS[name], bits, group_size if name in AFFINE else None]


class CaptureError(RuntimeError):
    """The cache no longer holds the tokens asked for (a window rotated them out)."""


class RestoreError(ValueError):
    """The given blocks cannot produce this layer's state at the asked position."""


def new_cache(spec: LayerSpec):
    """An empty mlx-lm cache object for one entry (what make_prompt_cache would give)."""
    if isinstance(spec, FullAttention):
        return KVCache()
    if isinstance(spec, QuantizedAttention):
        return QuantizedKVCache(group_size=spec.group_size, bits=spec.bits)
    if isinstance(spec, SlidingWindow):
        return RotatingKVCache(max_size=spec.window, keep=0)
    return ArraysCache(size=spec.arrays)


def sliding_keep(spec: SlidingWindow, block_tokens: int) -> int:
    """How many of a block's last tokens a sliding entry stores."""
    return min(block_tokens, spec.window)


# -- capture ---------------------------------------------------------------
def _capture_full(spec, cache: KVCache, start: int, end: int, block_tokens: int) -> list[mx.array]:
    return [cache.keys[..., start:end, :], cache.values[..., start:end, :]]


def _capture_quantized(spec, cache: QuantizedKVCache, start: int, end: int, block_tokens: int) -> list[mx.array]:
    return [part[..., start:end, :] for part in (*cache.keys, *cache.values)]


def _capture_sliding(spec: SlidingWindow, cache: RotatingKVCache, start: int, end: int,
                     block_tokens: int) -> list[mx.array]:
    keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    held = keys.shape[2]
    first_held = cache.offset - held  # absolute position of keys[..., 0, :]
    keep = sliding_keep(spec, block_tokens)
    lo, hi = end - keep - first_held, end - first_held
    if lo < 0 or hi > held:
        raise CaptureError(f"sliding window holds [{first_held}, {cache.offset}), block needs [{end - keep}, {end})")
    return [keys[..., lo:hi, :], values[..., lo:hi, :]]


CAPTURE: dict[type, Callable] = {
    FullAttention: _capture_full,
    QuantizedAttention: _capture_quantized,
    SlidingWindow: _capture_sliding,
    Recurrent: lambda spec, cache, start, end, block_tokens: [],
}


def capture_block(spec: LayerSpec, cache, start: int, end: int, block_tokens: int) -> list[mx.array]:
    """Arrays of tokens [start, end) for one entry (lazy slices; encode soon)."""
    return CAPTURE[type(spec)](spec, cache, start, end, block_tokens)


def capture_state(spec: LayerSpec, cache) -> list[mx.array]:
    """A recurrent entry's arrays right now (references: ArraysCache replaces, never mutates, them)."""
    if not isinstance(spec, Recurrent):
        return []
    if any(a is None for a in cache.cache):
        raise CaptureError("recurrent cache is empty")
    return list(cache.cache)


# -- what a block's payload must look like ---------------------------------------
def _signature(arrays: list, block_tokens: Optional[int]) -> tuple:
    """(dtype tag, shape) of each array, with the token axis (2) set to `block_tokens` if given."""
    out = []
    for a in arrays:
        shape = tuple(int(d) for d in a.shape)
        if block_tokens is not None:
            shape = shape[:2] + (block_tokens,) + shape[3:]
        out.append((str(a.dtype).removeprefix("mlx.core."), shape))
    return tuple(out)


def payload_signature(spec: LayerSpec, cache, block_tokens: int) -> tuple[tuple, tuple]:
    """What this entry stores in a KV block and in a checkpoint, read off a cache that holds a few tokens.

    KV blocks: full and quantized layers hold B token rows, sliding layers their
    stored tail of min(B, W) rows, recurrent layers nothing. Checkpoints: the
    recurrent arrays exactly as the live cache has them, nothing for the rest."""
    if isinstance(spec, Recurrent):
        return (), _signature(list(cache.cache), None)
    if isinstance(spec, QuantizedAttention):
        return _signature([*cache.keys, *cache.values], block_tokens), ()
    rows = sliding_keep(spec, block_tokens) if isinstance(spec, SlidingWindow) else block_tokens
    return _signature([cache.keys, cache.values], rows), ()


# -- restore ---------------------------------------------------------------
def _token_prefix(parts: list[list[mx.array]], n: int, capacity: int) -> list[mx.array]:
    """Concatenate parts (each its arrays for some tokens, axis 2) in order, keep the first n tokens, pad to
    `capacity`. Parts: per-block arrays, a run of blocks concatenated already, a prompt's tail (tails.py)."""
    used, have = [], 0
    for part in parts:
        if have >= n:
            break
        if part is None:
            break
        used.append(part)
        have += part[0].shape[2]
    if have < n:
        raise RestoreError(f"need {n} tokens, the parts hold {have} before a gap")
    out = []
    for k in range(len(used[0])):
        pieces = [p[k] for p in used]
        last = pieces[-1]
        pieces[-1] = last[..., :last.shape[2] - (have - n), :]
        first = pieces[0]
        pieces.append(mx.zeros((*first.shape[:2], capacity - n, first.shape[3]), dtype=first.dtype))
        out.append(mx.concatenate(pieces, axis=2))
    return out


def _restore_full(spec, parts, n: int, block_tokens: int, capacity: int):
    keys, values = _token_prefix(parts, n, capacity)
    cache = KVCache()
    cache.keys, cache.values, cache.offset = keys, values, n
    return cache


def _restore_quantized(spec: QuantizedAttention, parts, n: int, block_tokens: int, capacity: int):
    arrays = _token_prefix(parts, n, capacity)
    cache = QuantizedKVCache(group_size=spec.group_size, bits=spec.bits)
    cache.keys, cache.values, cache.offset = tuple(arrays[:3]), tuple(arrays[3:]), n
    return cache


def _restore_sliding(spec: SlidingWindow, parts, n: int, block_tokens: int, capacity: int):
    keep = sliding_keep(spec, block_tokens)
    need_from = max(0, n - spec.window)
    pieces_k, pieces_v, covered_to = [], [], None
    j = -(-n // block_tokens) - 1  # last block touching [.., n)
    have_from = n
    while have_from > need_from:
        if j < 0 or j >= len(parts) or parts[j] is None:
            raise RestoreError(f"sliding window needs tokens from {need_from}, block {j} is missing")
        lo, hi = (j + 1) * block_tokens - keep, min((j + 1) * block_tokens, have_from)
        if hi < have_from or (covered_to is not None and hi != covered_to):
            raise RestoreError("sliding payloads do not cover the window contiguously")
        k, v = parts[j]
        lo_abs = max(lo, need_from)
        off = lo_abs - lo
        pieces_k.insert(0, k[..., off: off + hi - lo_abs, :])
        pieces_v.insert(0, v[..., off: off + hi - lo_abs, :])
        have_from, covered_to, j = lo_abs, lo_abs, j - 1
    cache = RotatingKVCache(max_size=spec.window, keep=0)
    if n:
        cache.keys = mx.concatenate(pieces_k, axis=2)
        cache.values = mx.concatenate(pieces_v, axis=2)
        cache._idx = cache.keys.shape[2]
    cache.offset = n
    return cache


RESTORE: dict[type, Callable] = {
    FullAttention: _restore_full,
    QuantizedAttention: _restore_quantized,
    SlidingWindow: _restore_sliding,
}


def restore_entry(spec: LayerSpec, parts: list[Optional[list[mx.array]]], n: int, block_tokens: int,
                  capacity: int, state: Optional[list[mx.array]] = None):
    """Rebuild one cache entry at position n from per-block arrays (and, for recurrent, a checkpoint).

    Full and quantized entries take parts of any token length in order (`block_tokens` is for sliding
    ones, whose parts are blocks' stored tails). `capacity`: the token capacity of a K/V buffer (Schedule.capacity; a sliding window's is its own)."""
    if isinstance(spec, Recurrent):
        if state is None or len(state) != spec.arrays:
            raise RestoreError(f"recurrent entry needs a checkpoint at exactly {n}")
        cache = ArraysCache(size=spec.arrays)
        cache.cache = list(state)
        return cache
    return RESTORE[type(spec)](spec, parts, n, block_tokens, capacity)
