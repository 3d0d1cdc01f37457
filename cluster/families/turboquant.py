"""TurboQuant for K/V payloads: rotate, then quantize every coordinate with a Lloyd-Max codebook.

After a random rotation, each coordinate of a unit vector in dimension d follows
the same known density, f(x) ∝ (1 - x²)^((d-3)/2) on [-1, 1] (TurboQuant, arXiv
2504.19874, Lemma 1), so one scalar codebook per (d, bits), solved once, is
near-optimal for every vector. Per block of K (or V) rows [T, d] of one head:

    x ──► mean μ over the T rows (int8 × one float16 scale, kept; only with center=True)
      └─► r = x - μ ──► u = r / ‖r‖ ──► y = u·D·H ──► idx_j = nearest centroid of y_j    (packed: the first n
                                                      q = c[idx], scale = ‖r‖ / ‖q‖    coordinates of a row at
                                                      (uint8 log code per row)         bits+1, the rest at bits)
    decode: c[idx] ──► ·(D·H)ᵀ ──► × scale ──► + μ

- The rotation is a randomized Walsh-Hadamard transform (D: seeded ±1 signs, H:
  normalised Walsh-Hadamard), applied as one small d x d matrix product: for d <=
  256 a BLAS GEMM is far faster than an O(d log d) butterfly written in numpy,
  and the transform is the same. Its signs come from a seed (the fingerprint
  namespace), so every node rotates alike.
- Choices beyond the paper's MSE quantizer, each measured on attention output
  (`mlx-fleet bench turboquant`, docs/turboquant.md):
  - norm-preserving scale: Lloyd-Max centroids shrink a vector (‖q‖ < 1), and
    shrunken keys flatten every softmax. Scaling by ‖r‖/‖q‖ instead of ‖r‖ keeps
    each decoded row's norm exact, for the same bytes;
  - centring: softmax ignores a shift shared by all keys, and K/V rows of one
    head share a large common part. Quantizing only the residual from the
    block's mean spends the bits on what differs. The encoder subtracts the mean
    as decoded, so the mean's own rounding lands in the residual and is coded;
  - cheap side data, spent on coordinates: a centred block's mean is int8 with
    one scale, and its row scales are 8-bit codes on a log scale between the
    block's smallest and largest (neither costs measurable accuracy). What that
    saves against mlx's affine quantization at the same bits (a float16 scale and
    bias per 64 coordinates) buys a bit more for the first n rotated coordinates
    of every row (`extra_coordinates`: n = 15 of 64, 39 of 128 at tq4). After the
    rotation every coordinate is alike, so which ones get it does not matter.
    The payload stays at or below affine's at the same bits.
- Head dims must be powers of two (64, 128, 256 ...); `supports()` says so, and
  anything else stays lossless (the caller keeps it native).
- Codebooks are solved numerically on a fine grid of the exact density for d
  (Lloyd-Max iterations from quantile start points): deterministic, so two
  processes build the same bytes.
- Scales and means are bounded by float16's range, as the K/V of a float16 model
  are. A row whose norm passed 65504 would be clipped; no model's K/V come near,
  and the replica's start-up quality probe (status) would show it.

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
    """(indices, bytes) per group: the fewest whole indices that fill whole bytes (3 bits: 8 in 3 bytes,
    5 bits: 8 in 5). At most 56 bits for any width up to 8, so a group fits one uint64 word."""
    n = math.lcm(bits, 8)
    return n // bits, n // 8


def packed_nbytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """Indices (< 2**bits) to a little-endian bit stream, `bits` per index, ceil(count * bits / 8) bytes."""
    flat = idx.reshape(-1).astype(np.uint64)
    count = flat.size
    per, nbytes = _group(bits)
    flat = np.concatenate([flat, np.zeros(-count % per, dtype=np.uint64)]).reshape(-1, per)
    word = (flat << (bits * np.arange(per, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)
    out = word.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :nbytes].reshape(-1)
    return out[:packed_nbytes(count, bits)].copy()


def unpack(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    per, nbytes = _group(bits)
    groups = -(-count // per)
    raw = np.zeros((groups, 8), dtype=np.uint8)
    flat = raw[:, :nbytes].reshape(-1)  # a copy: filled, then put back
    flat[:data.size] = data[:groups * nbytes]
    raw[:, :nbytes] = flat.reshape(groups, nbytes)
    word = raw.view("<u8").reshape(-1)
    idx = (word[:, None] >> (bits * np.arange(per, dtype=np.uint64))) & np.uint64((1 << bits) - 1)
    return idx.reshape(-1)[:count].astype(np.uint8)


def log_scales(bits: int, center: bool) -> bool:
    """Whether row scales are 8-bit log codes (else float16). Only where the bits they save buy coordinates:
    a scale's error multiplies every attention score of its key, and with large scores (outlier channels)
    the codes' 0.1-0.5% cost tq8 more than its 8-bit coordinates do."""
    return center and bits < 8


def side_bits(rows: int, d: int, bits: int, center: bool) -> int:
    """Bits per head of a block spent beside the coordinates: the row scales (8-bit codes plus their base
    and step, or float16), and when centred the int8 mean row and its float16 scale."""
    scales = rows * 8 + 32 if log_scales(bits, center) else rows * 16
    return scales + (8 * d + 16 if center else 0)


def _spare(rows: int, d: int, bits: int, center: bool) -> int:
    """Bits per head left within mlx's affine quantization at the same bits (a float16 scale and bias per
    64 coordinates: bits + 0.5 per coordinate), 16 kept back for rounding the packed streams to whole bytes."""
    return rows * d // 2 - side_bits(rows, d, bits, center) - 16


def can_center(rows: int, d: int, bits: int) -> bool:
    """Whether a centred encoding of rows x d stays within affine's payload (tq8 needs 34 rows at d = 64)."""
    return _spare(rows, d, bits, True) >= 0


def extra_coordinates(rows: int, d: int, bits: int, center: bool) -> int:
    """How many rotated coordinates of every row get bits+1 instead of bits: what the spare bits afford.
    tq8 fills whole bytes already and gets none (its cosine is 0.99998)."""
    if bits >= 8 or rows <= 0:
        return 0
    return int(np.clip(_spare(rows, d, bits, center) // rows, 0, d))


def arrays(shape: tuple, bits: int, center: bool) -> list[tuple[str, tuple]]:
    """(dtype, shape) of each array an encoding of `shape` [..., rows, d] holds, in `Encoded.arrays()` order."""
    lead, rows, d = tuple(shape[:-2]), shape[-2], shape[-1]
    n = extra_coordinates(rows, d, bits, center)
    count = int(np.prod(shape[:-1]))
    packed = ("uint8", (packed_nbytes(count * (d - n), bits) + packed_nbytes(count * n, bits + 1),))
    scales = ("uint8" if log_scales(bits, center) else "float16", (*lead, rows))
    if center:
        side = ("float16", (*lead, 3 if log_scales(bits, center) else 1))
        return [side, ("int8", (*lead, 1, d)), scales, packed]
    return [scales, packed]


@dataclass(frozen=True)
class Encoded:
    """One K or V tensor [..., T, d], quantized: its shape and dtype name, packed indices (the first
    `extra_coordinates` of every row at bits+1, after all the others at bits), and per-row scales.

    Centred (`side` and `mean` set): the mean row is mean · side[-1]; below 8 bits the scales are uint8
    codes, 0 for a zero row, else side[0] · 2^((code - 1) · side[1]). Otherwise scales are float16."""

    shape: tuple[int, ...]
    dtype: str
    bits: int
    scales: np.ndarray  # uint8 codes [..., T] where log_scales(), else float16 [..., T]
    packed: np.ndarray  # uint8
    side: Optional[np.ndarray] = None  # float16 [..., 3]: smallest scale, log2 step of the codes, mean's scale
    #                                    (float16 scales: [..., 1], the mean's scale only)
    mean: Optional[np.ndarray] = None  # int8 [..., 1, d]

    @property
    def center(self) -> bool:
        return self.mean is not None

    def arrays(self) -> list[np.ndarray]:
        return ([self.side, self.mean] if self.center else []) + [self.scales, self.packed]

    @classmethod
    def of(cls, shape: tuple, dtype: str, bits: int, center: bool, held: list[np.ndarray]) -> "Encoded":
        """From `arrays()`'s list (as a block holds it)."""
        if center:
            side, mean, scales, packed = held
            return cls(tuple(shape), dtype, bits, scales, packed, side, mean)
        scales, packed = held
        return cls(tuple(shape), dtype, bits, scales, packed)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


_F16_MAX = float(np.finfo(np.float16).max)
_F16_TINY = float(np.finfo(np.float16).smallest_subnormal)


def _log_code(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row scales s [..., T] (>= 0) as uint8 codes on a log scale from the smallest to the largest of
    their T rows: (codes, float16 smallest, float16 step). The step is at most log2(range)/254, so a row's
    scale is within half a step: 0.1% for a 1.5x range, far below the 4-bit coordinates' error."""
    s = np.clip(s, 0.0, _F16_MAX)
    pos = s >= _F16_TINY
    smin = np.where(pos, s, np.inf).min(axis=-1)
    base16 = np.where(np.isinf(smin), 0.0, smin).astype(np.float16)
    base = base16.astype(np.float32)[..., None]
    span = np.maximum(np.log2(np.where(pos, s, 1.0) / np.where(base > 0, base, 1.0)), 0.0) * pos
    step16 = (span.max(axis=-1) / 254).astype(np.float16)
    step = step16.astype(np.float32)[..., None]
    codes = np.where(pos, 1 + np.clip(np.round(span / np.where(step > 0, step, 1.0)), 0, 254), 0)
    return codes.astype(np.uint8), base16, step16


def _scales(e: Encoded) -> np.ndarray:
    if e.scales.dtype != np.uint8:
        return e.scales.astype(np.float32)
    base, step = (e.side[..., i].astype(np.float32)[..., None] for i in (0, 1))
    codes = e.scales.astype(np.float32)
    return np.where(codes > 0, base * np.exp2((codes - 1) * step), 0.0)


def _mean(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows' mean [..., 1, d] as int8 times one float16 scale per head: (int8 row, float16 scale)."""
    m = v.mean(axis=-2, keepdims=True)
    a16 = np.clip(np.abs(m).max(axis=-1) / 127, 0.0, _F16_MAX).astype(np.float16)  # [..., 1]
    a = a16.astype(np.float32)[..., None]
    q = np.where(a > 0, np.clip(np.round(m / np.where(a > 0, a, 1.0)), -127, 127), 0)
    return q.astype(np.int8), a16[..., 0]


def encode(x: np.ndarray, bits: int, seed: bytes, center: bool = False) -> Encoded:
    """Quantize x [..., T, d] (any float dtype) with `bits` per coordinate (some at bits+1, see
    `extra_coordinates`); `center`: the residual from the mean of its T rows (a block's rows of one head)."""
    if bits not in BITS:
        raise ValueError(f"TurboQuant bits must be one of {BITS}, not {bits}")
    if x.ndim < 2:
        raise ValueError(f"TurboQuant encodes rows [..., T, d], not shape {x.shape}")
    d = x.shape[-1]
    if not supports(d):
        raise ValueError(f"TurboQuant needs a power-of-two head dim, not {d}")
    v = np.asarray(x, dtype=np.float32)
    mean = mscale = None
    if center:
        mean, mscale = _mean(v)
        v = v - mean.astype(np.float32) * mscale.astype(np.float32)[..., None, None]  # the decoded mean
    norms = np.linalg.norm(v, axis=-1)
    y = rotate(v / np.where(norms > 0, norms, 1.0)[..., None], seed)
    n = extra_coordinates(x.shape[-2], d, bits, center)
    lo, hi = nearest(y[..., n:], d, bits), nearest(y[..., :n], d, bits + 1)
    q = np.sqrt(np.sum(codebook(d, bits)[lo] ** 2, axis=-1) + np.sum(codebook(d, bits + 1)[hi] ** 2, axis=-1))
    s = norms / np.where(q > 0, q, 1.0)
    packed = np.concatenate([pack(lo, bits), pack(hi, bits + 1)])
    if not log_scales(bits, center):
        scales, side = np.clip(s, 0.0, _F16_MAX).astype(np.float16), [mscale]
    else:
        scales, base, step = _log_code(s)
        side = [base, step, mscale]
    if not center:
        return Encoded(tuple(x.shape), str(x.dtype), bits, scales, packed)
    return Encoded(tuple(x.shape), str(x.dtype), bits, scales, packed, np.stack(side, axis=-1), mean)


def decode(e: Encoded, seed: bytes, dtype=None) -> np.ndarray:
    """The float tensor back, in `dtype` (default: the encoded one's)."""
    d, rows = e.shape[-1], e.shape[-2]
    n = extra_coordinates(rows, d, e.bits, e.center)
    count = int(np.prod(e.shape[:-1]))
    split = packed_nbytes(count * (d - n), e.bits)
    y = np.empty(e.shape, dtype=np.float32)
    y[..., n:] = codebook(d, e.bits)[unpack(e.packed[:split], e.bits, count * (d - n))].reshape(
        *e.shape[:-1], d - n)
    if n:
        y[..., :n] = codebook(d, e.bits + 1)[unpack(e.packed[split:], e.bits + 1, count * n)].reshape(
            *e.shape[:-1], n)
    x = unrotate(y, seed) * _scales(e)[..., None]
    if e.center:
        x += e.mean.astype(np.float32) * e.side[..., -1].astype(np.float32)[..., None, None]
    return x.astype(dtype or e.dtype)
