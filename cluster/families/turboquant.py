"""TurboQuant for K/V payloads: rotate, then quantize every coordinate with a Lloyd-Max codebook.

After a random rotation, each coordinate of a unit vector in dimension d follows
the same known density, f(x) ∝ (1 - x²)^((d-3)/2) on [-1, 1] (TurboQuant, arXiv
2504.19874, Lemma 1), so one scalar codebook per (d, bits), solved once, is
near-optimal for every vector. Per block of K (or V) rows [T, d] of one head:

    x ──► mean μ over the T rows (float16, kept; only with center=True)
      └─► r = x - μ ──► u = r / ‖r‖ ──► y = u·D·H ──► idx_j = nearest centroid of y_j  (bits each, packed)
                                                      q = c[idx], scale = ‖r‖ / ‖q‖  (float16, kept per row)
    decode: c[idx] ──► ·(D·H)ᵀ ──► × scale ──► + μ

- The rotation is a randomized Walsh-Hadamard transform (D: seeded ±1 signs, H:
  normalised Walsh-Hadamard), applied as one small d x d matrix product: for d <=
  256 a BLAS GEMM is far faster than an O(d log d) butterfly written in numpy,
  and the transform is the same. Its signs come from a seed (the fingerprint
  namespace), so every node rotates alike.
- Two choices beyond the paper's MSE quantizer, both measured on attention
  output (`mlx-fleet bench turboquant`, docs/turboquant.md):
  - norm-preserving scale: Lloyd-Max centroids shrink a vector (‖q‖ < 1), and
    shrunken keys flatten every softmax. Scaling by ‖r‖/‖q‖ instead of ‖r‖ keeps
    each decoded row's norm exact, for the same bytes;
  - centring: softmax ignores a shift shared by all keys, and K/V rows of one
    head share a large common part. Quantizing only the residual from the
    block's mean spends the bits on what differs. One float16 mean per head per
    block (0.25 bit per coordinate at 64 rows) pays for itself several times.
- Head dims must be powers of two (64, 128, 256 ...); `supports()` says so, and
  anything else stays lossless (the caller keeps it native).
- Codebooks are solved numerically on a fine grid of the exact density for d
  (Lloyd-Max iterations from quantile start points): deterministic, so two
  processes build the same bytes.
- Scales and means are float16, as the K/V of a float16 model are. A row whose
  norm passed 65504 would be clipped; no model's K/V come near, and the
  replica's start-up quality probe (status) would show it.

Everything is vectorised numpy; no Python loop runs per element.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

BITS = (2, 3, 4, 8)
_GRID = 1 << 18  # density grid points for solving a codebook
_ITERS = 400


def supports(d: int) -> bool:
    """Dimensions the rotation handles: powers of two."""
    return d >= 2 and d & (d - 1) == 0


@lru_cache(maxsize=16)
def hadamard(d: int) -> np.ndarray:
    """The normalised d x d Walsh-Hadamard matrix (Sylvester's construction): symmetric and orthonormal."""
    assert supports(d), d
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.float32(np.sqrt(d))).astype(np.float32)


@lru_cache(maxsize=64)
def signs(seed: bytes, d: int) -> np.ndarray:
    """The rotation's ±1 diagonal for dimension d, derived from `seed` (the same on every node)."""
    digest = hashlib.blake2b(seed + d.to_bytes(4, "little"), digest_size=32, person=b"mlxf-tq-signs").digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
    return np.where(rng.random(d) < 0.5, -1.0, 1.0).astype(np.float32)


@lru_cache(maxsize=64)
def rotation(seed: bytes, d: int) -> np.ndarray:
    """R = D·H: rotate row vectors with x @ R, undo with y @ R.T. One small GEMM (d <= 256) beats an FWHT
    written in numpy by far; the transform is the same."""
    return (signs(seed, d)[:, None] * hadamard(d)).astype(np.float32)


def rotate(x: np.ndarray, seed: bytes) -> np.ndarray:
    return np.asarray(x, dtype=np.float32) @ rotation(seed, x.shape[-1])


def unrotate(y: np.ndarray, seed: bytes) -> np.ndarray:
    return np.asarray(y, dtype=np.float32) @ rotation(seed, y.shape[-1]).T


@lru_cache(maxsize=64)
def codebook(d: int, bits: int) -> np.ndarray:
    """Lloyd-Max centroids (ascending, float32) for one rotated coordinate of a unit vector in dimension d."""
    reach = min(1.0, 16 / np.sqrt(d))  # beyond 16 standard deviations the density is ~0: spend the grid inside
    x = np.linspace(-reach, reach, _GRID + 2)[1:-1]
    logf = (d - 3) / 2 * np.log1p(-x * x) if d > 3 else np.zeros_like(x)
    w = np.exp(logf - logf.max())
    w /= w.sum()
    # Start from the high-resolution optimum (centroid density ∝ f^(1/3), Panter-Dite), then iterate.
    dense = np.cumsum(w ** (1 / 3))
    dense /= dense[-1]
    k = 1 << bits
    c = np.interp((np.arange(k) + 0.5) / k, dense, x)
    for _ in range(_ITERS):
        edges = (c[1:] + c[:-1]) / 2
        cell = np.searchsorted(edges, x)
        mass = np.bincount(cell, weights=w, minlength=k)
        moment = np.bincount(cell, weights=w * x, minlength=k)
        new = np.where(mass > 0, moment / np.maximum(mass, 1e-300), c)
        if np.max(np.abs(new - c)) < 1e-10:
            c = new
            break
        c = new
    c = (c - c[::-1]) / 2  # the density is symmetric: make the codebook exactly so
    return c.astype(np.float32)


_CELLS = 1 << 16  # lookup cells over [-1, 1]: far finer than the closest two codebook edges


@lru_cache(maxsize=64)
def _lookup(d: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(first index of each cell, edges padded with +inf): nearest-centroid search as a table lookup plus
    one comparison, instead of a binary search per coordinate."""
    c = codebook(d, bits)
    edges = (c[1:] + c[:-1]) / 2
    assert np.min(np.diff(edges), initial=1.0) > 2.0 / _CELLS, "cells must not hold two edges"
    lower = -1.0 + 2.0 * np.arange(_CELLS) / _CELLS
    return np.searchsorted(edges, lower, side="right").astype(np.int32), np.append(edges, np.inf).astype(np.float32)


def nearest(y: np.ndarray, d: int, bits: int) -> np.ndarray:
    """Index of the nearest codebook centroid of every coordinate of y (values in [-1, 1])."""
    first, edges = _lookup(d, bits)
    cell = np.clip(((y + 1.0) * (_CELLS / 2)).astype(np.int32), 0, _CELLS - 1)
    idx = first[cell]
    return (idx + (y > edges[idx])).astype(np.uint8)


def _group(bits: int) -> tuple[int, int]:
    """(indices, bytes) per group: the fewest whole indices that fill whole bytes (3 bits: 8 in 3 bytes)."""
    n = math.lcm(bits, 8)
    return n // bits, n // 8


def pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """Indices (< 2**bits) to a little-endian bit stream, `bits` per index, ceil(count * bits / 8) bytes."""
    flat = idx.reshape(-1).astype(np.uint32)
    count = flat.size
    per, nbytes = _group(bits)
    flat = np.concatenate([flat, np.zeros(-count % per, dtype=np.uint32)]).reshape(-1, per)
    word = (flat << (bits * np.arange(per, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
    out = word.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :nbytes].reshape(-1)
    return out[:-(-count * bits // 8)].copy()


def unpack(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    per, nbytes = _group(bits)
    groups = -(-count // per)
    raw = np.zeros((groups, 4), dtype=np.uint8)
    flat = raw[:, :nbytes].reshape(-1)  # a copy: filled, then put back
    flat[:data.size] = data[:groups * nbytes]
    raw[:, :nbytes] = flat.reshape(groups, nbytes)
    word = raw.view("<u4").reshape(-1)
    idx = (word[:, None] >> (bits * np.arange(per, dtype=np.uint32))) & ((1 << bits) - 1)
    return idx.reshape(-1)[:count].astype(np.uint8)


@dataclass(frozen=True)
class Encoded:
    """One K or V tensor [..., T, d], quantized: its shape and dtype name, packed indices, per-row scales and,
    when centred, the mean row over its T rows."""

    shape: tuple[int, ...]
    dtype: str
    scales: np.ndarray  # float16, one per row (shape[:-1])
    packed: np.ndarray  # uint8
    bits: int
    mean: Optional[np.ndarray] = None  # float16 [..., 1, d]; None: not centred

    @property
    def nbytes(self) -> int:
        return self.scales.nbytes + self.packed.nbytes + (self.mean.nbytes if self.mean is not None else 0)


_F16_MAX = float(np.finfo(np.float16).max)


def encode(x: np.ndarray, bits: int, seed: bytes, center: bool = False) -> Encoded:
    """Quantize x [..., T, d] (any float dtype) with `bits` per coordinate; `center`: the residual from the
    mean of its T rows (a block's rows of one head)."""
    if bits not in BITS:
        raise ValueError(f"TurboQuant bits must be one of {BITS}, not {bits}")
    d = x.shape[-1]
    if not supports(d):
        raise ValueError(f"TurboQuant needs a power-of-two head dim, not {d}")
    v = np.asarray(x, dtype=np.float32)
    mean = None
    if center:
        mean = np.clip(v.mean(axis=-2, keepdims=True), -_F16_MAX, _F16_MAX).astype(np.float16)
        v = v - mean.astype(np.float32)
    norms = np.linalg.norm(v, axis=-1)
    y = rotate(v / np.where(norms > 0, norms, 1.0)[..., None], seed)
    idx = nearest(y, d, bits)
    q = np.linalg.norm(codebook(d, bits)[idx], axis=-1)
    scales = np.clip(norms / np.where(q > 0, q, 1.0), 0.0, _F16_MAX).astype(np.float16)
    return Encoded(tuple(x.shape), str(x.dtype), scales, pack(idx, bits), bits, mean)


def decode(e: Encoded, seed: bytes, dtype=None) -> np.ndarray:
    """The float tensor back, in `dtype` (default: the encoded one's)."""
    d = e.shape[-1]
    count = int(np.prod(e.shape))
    y = codebook(d, e.bits)[unpack(e.packed, e.bits, count)].reshape(e.shape)
    x = unrotate(y, seed) * e.scales.astype(np.float32)[..., None]
    if e.mean is not None:
        x += e.mean.astype(np.float32)
    return x.astype(dtype or e.dtype)
