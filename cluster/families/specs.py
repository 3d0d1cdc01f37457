"""Typed, frozen specs of one cache entry each; a model's layout is a tuple of them.

Entries are indexed by cache position, not by layer: gemma4's KV-shared tail
layers have no cache of their own, so len(layout) can be < number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class FullAttention:
    """A KVCache: per-token K/V, sliceable along the token axis."""

    kind = "full"

    def describe(self) -> list:
        return [self.kind]


@dataclass(frozen=True)
class SlidingWindow:
    """A RotatingKVCache(max_size=window, keep=0): attention over the last `window` tokens."""

    window: int
    kind = "sliding"

    def describe(self) -> list:
        return [self.kind, self.window]


@dataclass(frozen=True)
class Recurrent:
    """An ArraysCache (conv + gated-delta state): one snapshot valid at exactly one position."""

    arrays: int
    kind = "recurrent"

    def describe(self) -> list:
        return [self.kind, self.arrays]


@dataclass(frozen=True)
class QuantizedAttention:
    """A QuantizedKVCache: per-token K/V as (packed, scales, biases), sliceable like full attention."""

    bits: int
    group_size: int
    kind = "quantized"

    def describe(self) -> list:
        return [self.kind, self.bits, self.group_size]


LayerSpec = Union[FullAttention, SlidingWindow, Recurrent, QuantizedAttention]


@dataclass(frozen=True)
class Layout:
    """The cache layout of one model, entry by entry."""

    family: str
    layers: tuple[LayerSpec, ...]

    def describe(self) -> list:
        """Canonical, msgpack-able form: goes into block headers and the fingerprint."""
        return [spec.describe() for spec in self.layers]

    @property
    def has_recurrent(self) -> bool:
        return any(isinstance(s, Recurrent) for s in self.layers)

    def windows(self) -> list[int]:
        return [s.window for s in self.layers if isinstance(s, SlidingWindow)]
