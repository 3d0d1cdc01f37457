"""Token sampling with a per-request random key.

mlx-lm's samplers draw from MLX's global random state. A replica interleaves
many requests, so a request's `seed` must own its own key stream: the same
seed then gives the same tokens whatever else the replica is doing.
Temperature 0 is argmax, deterministic by construction.
"""

from __future__ import annotations

import os

import mlx.core as mx

from cluster.engine.request import SamplingParams


class Sampler:
    """Samples one token from the last position's logits; owns the key stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed % (1 << 64))  # int64 -> uint64, one to one: distinct seeds, distinct keys

    def __call__(self, logits: mx.array) -> mx.array:
        """`logits` is [1, vocab]; returns a [1] token array (lazy)."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        self._key, sub = mx.random.split(self._key)
        scaled = logits.astype(mx.float32) / self.params.temperature
        if self.params.top_p < 1.0:
            scaled = _top_p(scaled, self.params.top_p)
        return mx.random.categorical(scaled, key=sub)


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of tokens whose probability mass reaches top_p."""
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    cumulative = mx.cumsum(sorted_probs, axis=-1)
    # A token stays if the mass before it is still below top_p (so the top one always stays).
    keep_sorted = (cumulative - sorted_probs) < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, mx.array(-float("inf"), logits.dtype))
