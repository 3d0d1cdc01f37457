"""A prompt's tail: its final, partial prefill chunk, kept so that the very same prompt restores whole.

On the canonical schedule (engine/schedule.py) only blocks of complete chunks serve a hit. A prompt's
final chunk [kept, L - 1) is shorter than C, so a longer prompt's cold run computes those positions with
more rows, and a GPU rounds them differently. With blocks alone, every repeat of a prompt recomputes up
to C - 1 tokens: on the 8B shape at 8k tokens that is about 0.02 s of a 0.05 s hit.

The same prompt's cold run computes exactly that chunk again: the same rows, after the same prefix. So
the chunk's bytes are what a cold run gives for any prompt whose first L - 1 tokens are these. The last
token may differ, since it always runs alone. A tail keeps them:
- keyed by the id of the block at `kept` and the tokens [kept, L - 1) (store/hashing.tail_key). Only a
  prompt of this very length and prefix finds it;
- holding per layer:
  - full and quantized layers: the K/V of [kept, L - 1);
  - sliding layers: the whole window at L - 1 (the last min(W, L - 1) tokens);
  - recurrent layers: the state at L - 1;
- in the device RAM tier only. It is never spilled, announced or pulled: what it saves, part of a chunk,
  is cheap to recompute anywhere, and there is no envelope format to version.
A hit on a tail restores L - 1 tokens, the kept blocks and then the tail, and the last token runs alone,
as in the cold run.

No tail is kept of a one-token chunk where the model has sliding windows. mlx-lm's RotatingKVCache writes a
one-token step in place: once the window is full, that write rotates the ring, so at L - 1 the cold cache
holds the window with its newest token in slot 0. A restore lays the window out in order, the last token
then lands in another slot, and its attention sums the same terms in another order (1e-5 off in float32
on the CPU, tokens equal). Recomputing that one token is the cold run's own step, and costs what the tail
would save.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cluster.families.codecs import capture_block, capture_state
from cluster.families.specs import Layout, Recurrent, SlidingWindow
from cluster.kvcache import device_blocks
from cluster.kvcache.device_blocks import DeviceBlock, Run
from cluster.store.arrays import dtype_tag


@dataclass(eq=False)
class Tail(DeviceBlock):
    """A DeviceBlock of kind "tail" that carries its own runs (its token count is the prompt's)."""

    layout: tuple[Run, ...] = ()

    def entry(self, e: int) -> list[mx.array]:
        """The arrays of cache entry e, as views."""
        return [self.member(r, i) for r, run in enumerate(self.layout)
                for i, (entry, _) in enumerate(run.members) if entry == e]


def capture_tail(layout: Layout, caches: list, key: bytes, parent: bytes, start: int, tokens: list[int]) -> Tail:
    """The tail [start, start + len(tokens)) of live caches right after the prefill that ends there (lazy
    device copies; PrefixCache.seal evaluates them)."""
    end = start + len(tokens)
    entries = []
    for spec, cache in zip(layout.layers, caches):
        if isinstance(spec, Recurrent):
            entries.append(capture_state(spec, cache))
        elif isinstance(spec, SlidingWindow):  # a "block" of `end` tokens keeps the last min(W, end) of them
            entries.append(capture_block(spec, cache, start, end, end))
        else:
            entries.append(capture_block(spec, cache, start, end, end - start))
    runs = device_blocks.runs_of([[(dtype_tag(a.dtype), a.shape) for a in arrays] for arrays in entries])
    block = device_blocks.capture("tail", key, parent, start, tokens, entries, runs)
    return Tail(block.kind, block.id, block.parent, block.start, block.tokens, block.runs, runs)
