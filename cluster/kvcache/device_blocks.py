"""Blocks kept as MLX arrays: what the RAM tier holds of a replica's own blocks.

A restore from host bytes costs one host-to-device copy per array (9,216 of
them for an 8k-token prompt of an 8B model), a checksum pass and a
concatenation; on a GPU that is several times a cold prefill. So the RAM tier
keeps each block on the device, laid out for a restore:

- A block's arrays (every layer's K and V for its B tokens, or a checkpoint's
  recurrent arrays) are cut into runs: consecutive arrays of one dtype and
  shape (`runs_of`, a function of the payload signature only). Each run is one
  MLX array, the members stacked on a new leading axis: one array per block
  for a dense model.
- A capture is one device copy per run (`capture`); a restore concatenates one
  array per run over the blocks, and takes each layer's K and V as views of it.

Nothing here crosses the process boundary, so nothing here is checked: a block
this process made from its own caches is right by construction. Where bytes
leave or enter (a spill, a disk read, a peer's block), `to_host` and
`from_host` convert, and the envelope (store/block_format.py) carries the
checksums and the layout checks.

All of it is MLX work, so it runs on the model thread; `to_host` returns numpy
views of evaluated arrays, which other threads may read.
"""

from __future__ import annotations

from dataclasses import dataclass
import mlx.core as mx
import numpy as np

from cluster.kernels import cuda_upload
from cluster.store.arrays import host_views
from cluster.store.block_format import Block, Signature, Tagged


@dataclass(frozen=True)
class Run:
    """Consecutive arrays of a block with one dtype and shape, stored as one stacked array."""

    tag: str  # mlx dtype name
    shape: tuple[int, ...]  # each member's shape
    members: tuple[tuple[int, int], ...]  # (entry, index within the entry) of each member, in order


def runs_of(signature: Signature) -> tuple[Run, ...]:
    """The runs of a payload signature (entries of (dtype tag, shape) per array)."""
    runs: list[list] = []
    for e, arrays in enumerate(signature):
        for k, (tag, shape) in enumerate(arrays):
            shape = tuple(int(d) for d in shape)
            if runs and runs[-1][0] == tag and runs[-1][1] == shape:
                runs[-1][2].append((e, k))
            else:
                runs.append([tag, shape, [(e, k)]])
    return tuple(Run(tag, shape, tuple(members)) for tag, shape, members in runs)


@dataclass(eq=False)
class DeviceBlock:
    """One block (or checkpoint) as the RAM tier holds it: its header fields and its runs on the device."""

    kind: str  # "kv" | "state"
    id: bytes
    parent: bytes
    start: int
    tokens: np.ndarray  # uint32
    runs: list[mx.array]  # one per Run: [members, *shape]

    @property
    def nbytes(self) -> int:
        """What the RAM tier's budget counts."""
        return sum(a.nbytes for a in self.runs)

    def member(self, run: int, i: int) -> mx.array:
        """Member i of run `run`: a view, no copy."""
        return mx.squeeze(self.runs[run][i:i + 1], 0)


def capture(kind: str, block_id: bytes, parent: bytes, start: int, tokens, entries: list[list[mx.array]],
            runs: tuple[Run, ...]) -> DeviceBlock:
    """A block from the arrays of a live cache (lazy slices): one device copy per run, lazy too.

    The copy matters: a slice would keep the whole live cache buffer alive, and stop the next
    chunk from updating it in place."""
    stacked = []
    for run in runs:
        members = [entries[e][k] for e, k in run.members]
        stacked.append(mx.stack(members) if len(members) > 1 else mx.array(members[0])[None])
    return DeviceBlock(kind, block_id, parent, start, np.asarray(tokens, dtype="<u4"), stacked)


def capture_span(heads: list[tuple[bytes, bytes, int, object]], entries: list[list[mx.array]],
                 runs: tuple[Run, ...], block_tokens: int) -> list[DeviceBlock]:
    """KV blocks back to back, from each array's slice of their whole span (token axis 2, the span starting
    at the first block): one stack per run, then one copy per block and run. A forward that completes
    eight blocks costs a run's members plus eight copies, not eight times the members.

    `heads`: (id, parent, start, tokens) of each block, in order; start - heads[0]'s start is its offset."""
    spans = [mx.stack([entries[e][k] for e, k in run.members]) for run in runs]  # [members, 1, H, span, D]
    first = heads[0][2]
    out = []
    for block_id, parent, start, tokens in heads:
        lo = start - first
        stacked = [mx.array(span[:, :, :, lo:lo + block_tokens]) for span in spans]
        out.append(DeviceBlock("kv", block_id, parent, start, np.asarray(tokens, dtype="<u4"), stacked))
    return out


def seal(blocks: list[DeviceBlock]) -> None:
    """Evaluate the captures together (one sync), so the live caches' buffers are free to update in place."""
    if blocks:
        mx.eval([a for b in blocks for a in b.runs])


def to_host(blocks: list[DeviceBlock], runs: list[tuple[Run, ...]], n_entries: int) -> list[list[list[Tagged]]]:
    """Each block's entries as numpy views of its device arrays (one evaluation for all; no copy on
    unified memory). `runs`: each block's runs (by its kind)."""
    views = iter(host_views([a for b in blocks for a in b.runs]))
    out = []
    for block, block_runs in zip(blocks, runs):
        entries: list[list[Tagged]] = [[] for _ in range(n_entries)]
        for run in block_runs:
            tag, stacked = next(views)
            for i, (e, _) in enumerate(run.members):
                entries[e].append((tag, stacked[i]))
        out.append(entries)
    return out


def from_host(blocks: list[Block], runs: list[tuple[Run, ...]]) -> list[DeviceBlock]:
    """Decoded (and so checked) blocks' numpy arrays, moved to the device together: one array per block and
    run, in one upload (on CUDA by DMA, kernels/cuda_upload.py). `runs`: each block's runs (by its kind)."""
    tagged = [(run.tag, _stacked([block.entries[e][k][1] for e, k in run.members]))
              for block, block_runs in zip(blocks, runs) for run in block_runs]
    arrays = iter(cuda_upload.upload(tagged))
    return [DeviceBlock(block.kind, block.id, block.parent, block.start, np.asarray(block.tokens, dtype="<u4"),
                        [next(arrays) for _ in block_runs]) for block, block_runs in zip(blocks, runs)]


def _stacked(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays as one [len, *shape] array: a view when they lie back to back in one buffer (as a
    decoded envelope's do when each array's size is a multiple of the alignment), else a copy."""
    first = arrays[0]
    step = first.nbytes
    base = first.__array_interface__["data"][0]
    if first.flags.c_contiguous and all(
            a.flags.c_contiguous and a.__array_interface__["data"][0] == base + i * step
            for i, a in enumerate(arrays)):
        # The members are live and back to back; the view is only read before they are let go (from_host).
        return np.lib.stride_tricks.as_strided(first, shape=(len(arrays), *first.shape),
                                               strides=(step, *first.strides), writeable=False)
    return np.stack(arrays)


def same(a: DeviceBlock, b: DeviceBlock) -> bool:
    """Bitwise the same block: header fields and every array."""
    return (a.kind == b.kind and a.id == b.id and a.parent == b.parent and a.start == b.start
            and np.array_equal(a.tokens, b.tokens) and len(a.runs) == len(b.runs)
            and all(x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
                    for x, y in zip(a.runs, b.runs)))

