"""The KV payload codec: how a block's K/V arrays are kept in the tiers and sent between nodes.

`native` keeps them as the model computed them (exact). `tq8|tq4|tq3|tq2` keep
attention K/V TurboQuant-packed (families/turboquant.py) and decode them back to
the model dtype before restore, so the model always runs native caches:

    capture ─► [K, V] per attention entry ─► encode ─► [K mean, K scales, K packed, V mean, ...] ─► tiers, peers
    restore ◄─ [K, V] in the model dtype ◄── decode ◄─────────────────────────────────────────────┘

Each K and V array is one block's rows of every head, [1, heads, rows, d]. It is
centred on its per-head mean row when it has at least CENTER_MIN_ROWS rows (the
int8 mean and its scales then cost at most a quarter bit per coordinate; below
that they would cost more than they save, so short blocks keep plain rows,
float16 scales and no mean).

What stays lossless, and why:
- recurrent state (checkpoints): one wrong bit there is carried into every later
  token, and it is small next to K/V;
- attention entries whose head dim is not a power of two (the rotation needs one);
- everything in checkpoint blocks.

Sliding-window entries are encoded like full ones: a block stores their tail as
plain K/V rows, so the codec never needs to know about the window (mlx-lm's own
QuantizedKVCache cannot do sliding windows; this does not need to).

The RAM tier keeps blocks encoded too: tq4 needs about 0.28x the bytes of
float16 K/V, so the same RAM budget holds about 3.5x more blocks; each hit pays
one decode (numpy, off the model thread, in admission).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from cluster.families import turboquant as tq
from cluster.families.specs import FullAttention, Layout, SlidingWindow
from cluster.store.block_format import Signature, Tagged

TQ_BITS = {"tq8": 8, "tq4": 4, "tq3": 3, "tq2": 2}
CENTER_MIN_ROWS = 32


def to_float32(tagged: Tagged) -> np.ndarray:
    tag, a = tagged
    if tag == "bfloat16":  # travels as its uint16 bits
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


def from_float32(x: np.ndarray, tag: str) -> Tagged:
    if tag == "bfloat16":  # round to nearest even, as a cast would
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        return tag, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return tag, x.astype(tag)


class TurboQuantPayload:
    """Encodes and decodes the attention K/V of KV blocks for one model (layout, native signature, seed)."""

    def __init__(self, name: str, layout: Layout, native: Signature, seed: bytes):
        self.name = name
        self.bits = TQ_BITS[name]
        self.seed = seed
        self.native = native
        # Entries it encodes: attention K and V with a power-of-two head dim.
        self.coded = [isinstance(spec, (FullAttention, SlidingWindow)) and len(sig) == 2
                      and all(tq.supports(shape[-1]) for _, shape in sig)
                      for spec, sig in zip(layout.layers, native)]

    def signature(self) -> Signature:
        """What an encoded KV block holds, entry by entry (block_format checks it like any payload)."""
        out = []
        for sig, coded in zip(self.native, self.coded):
            if not coded:
                out.append(sig)
                continue
            out.append(tuple(a for _, shape in sig for a in tq.arrays(shape, self.bits, centred(shape, self.bits))))
        return tuple(out)

    def encode(self, entries: list[list[Tagged]]) -> list[list[Tagged]]:
        out = []
        for arrays, coded in zip(entries, self.coded):
            if not coded:
                out.append(arrays)
                continue
            packed = []
            for tagged in arrays:
                e = tq.encode(to_float32(tagged), self.bits, self.seed, center=centred(tagged[1].shape, self.bits))
                packed += [(a.dtype.name, a) for a in e.arrays()]
            out.append(packed)
        return out

    def decode(self, entries: list[list[Tagged]]) -> list[list[Tagged]]:
        out = []
        for arrays, coded, sig in zip(entries, self.coded, self.native):
            if not coded:
                out.append(arrays)
                continue
            kv, at = [], 0
            for tag, shape in sig:
                center = centred(shape, self.bits)
                n = len(tq.arrays(shape, self.bits, center))
                held, at = [a for _, a in arrays[at:at + n]], at + n
                x = tq.decode(tq.Encoded.of(shape, "float32", self.bits, center, held), self.seed)
                kv.append(from_float32(x, tag))
            out.append(kv)
        return out

    def quality(self, entries: list[list[Tagged]]) -> dict:
        """Measured on real K/V (the start-up probe's): cosine mean and 1st percentile, relative MSE."""
        cos, rel = [], []
        for arrays, back, coded in zip(entries, self.decode(self.encode(entries)), self.coded):
            if not coded:  # kept native: comparing it with itself would only inflate the numbers
                continue
            for a, b in zip(arrays, back):
                x, y = to_float32(a).reshape(-1, a[1].shape[-1]), to_float32(b).reshape(-1, b[1].shape[-1])
                nx, ny = np.linalg.norm(x, axis=-1), np.linalg.norm(y, axis=-1)
                keep = nx > 0
                cos.append((np.sum(x * y, axis=-1)[keep] / (nx * np.maximum(ny, 1e-30))[keep]))
                rel.append((np.sum((x - y) ** 2, axis=-1)[keep] / (nx[keep] ** 2)))
        if not cos:
            return {"codec": self.name, "coded_entries": 0}
        c, r = np.concatenate(cos), np.concatenate(rel)
        return {"codec": self.name, "coded_entries": int(sum(self.coded)), "entries": len(self.coded),
                "cosine_mean": round(float(c.mean()), 6), "cosine_p1": round(float(np.percentile(c, 1)), 6),
                "rel_mse": float(r.mean()), "vectors": int(c.size)}


def centred(shape: tuple, bits: int) -> bool:
    """Whether an array of this shape [..., rows, d] is coded as its residual from the mean row: from
    CENTER_MIN_ROWS rows, where the mean stays within affine quantization's payload (tq8 at d = 64: 34)."""
    return len(shape) >= 2 and shape[-2] >= CENTER_MIN_ROWS and tq.can_center(shape[-2], shape[-1], bits)


def payload_codec(name: str, layout: Layout, native: Signature, seed: bytes) -> Optional[TurboQuantPayload]:
    """The codec for `--kv-codec name`, or None where blocks keep the model's own arrays."""
    return TurboQuantPayload(name, layout, native, seed) if name in TQ_BITS else None
