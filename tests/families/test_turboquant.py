"""TurboQuant core: an orthonormal seeded rotation, Lloyd-Max codebooks at the paper's distortion, exact packing."""

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cluster.families import turboquant as tq

SEED = b"namespace-of-some-model-0123456789"
PAPER_MSE = {2: 0.117, 3: 0.0345, 4: 0.0095, 8: 4.03e-5}  # unit vectors, d = 128 (kvquant.md §1.2)


def vectors(shape=(3, 2, 64, 128), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3.0


@pytest.mark.parametrize("d", [2, 64, 128, 256])
def test_the_rotation_is_orthonormal_and_its_inverse_restores_the_input(d):
    r = tq.rotation(SEED, d)
    assert np.abs(r @ r.T - np.eye(d)).max() < 1e-5
    x = vectors((5, d))
    assert np.abs(tq.unrotate(tq.rotate(x, SEED), SEED) - x).max() < 1e-4
    assert np.allclose(np.linalg.norm(tq.rotate(x, SEED), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_the_rotation_depends_on_the_seed_only():
    assert np.array_equal(tq.rotation(SEED, 128), tq.rotation(bytes(SEED), 128))
    assert not np.array_equal(tq.signs(SEED, 128), tq.signs(b"another namespace", 128))


@pytest.mark.parametrize("bits", tq.BITS)
def test_codebooks_are_ascending_symmetric_and_at_the_papers_distortion(bits):
    c = tq.codebook(128, bits)
    assert c.shape == (1 << bits,) and np.all(np.diff(c) > 0) and np.array_equal(c, -c[::-1])
    x = vectors((4096, 128), seed=bits)
    y = tq.rotate(x / np.linalg.norm(x, axis=-1, keepdims=True), SEED)
    mse = float(np.mean(np.sum((c[tq.nearest(y, 128, bits)] - y) ** 2, axis=-1)))
    assert 4.0 ** -bits <= mse <= 2.72 * 4.0 ** -bits  # the lower bound and Panter-Dite's upper one
    assert mse == pytest.approx(PAPER_MSE[bits], rel=0.06)


@pytest.mark.parametrize("bits", (*tq.BITS, 5))  # 5: tq4's extra-bit coordinates
@pytest.mark.parametrize("count", [1, 7, 8, 1000])
def test_packing_round_trips_any_count(bits, count):
    idx = np.random.default_rng(count).integers(0, 1 << bits, size=count, dtype=np.uint8)
    packed = tq.pack(idx, bits)
    assert packed.dtype == np.uint8 and packed.nbytes == -(-count * bits // 8)
    assert np.array_equal(tq.unpack(packed, bits, count), idx)


def test_packing_is_a_little_endian_bit_stream():
    # index i occupies bits [i*bits, (i+1)*bits) of the stream, least significant first
    assert tq.pack(np.array([1, 2, 3], dtype=np.uint8), 3).tolist() == [0b11010001, 0b00000000]
    assert tq.pack(np.array([31, 1], dtype=np.uint8), 5).tolist() == [0b00111111, 0b00000000]


@pytest.mark.parametrize("bits", tq.BITS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("center", [False, True])
def test_round_trip_keeps_shape_dtype_and_norms(bits, dtype, center):
    x = vectors().astype(dtype)
    e = tq.encode(x, bits, SEED, center=center)
    y = tq.decode(e, SEED)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert [(a.dtype.name, a.shape) for a in e.arrays()] == tq.arrays(x.shape, bits, center)
    assert e.scales.dtype == (np.uint8 if center and bits < 8 else np.float16)
    x32, y32 = x.astype(np.float32), y.astype(np.float32)
    mean = 0.0
    if center:
        assert e.mean.shape == (3, 2, 1, 128) and e.mean.dtype == np.int8 and e.side.shape == (3, 2, 3 if bits < 8 else 1)
        mean = e.mean.astype(np.float32) * e.side[..., -1:, None].astype(np.float32)
        exact = x32.mean(axis=-2, keepdims=True)
        # int8 of the largest |coordinate|: within half a step (plus float16's rounding of the step)
        assert np.all(np.abs(mean - exact) <= np.abs(exact).max(axis=-1, keepdims=True) / 254 * 1.01)
    # Norm-preserving: every decoded row (residual) has its input's norm, to float16's precision or within
    # half a step of the log-coded scales (their range here is under 2x: a step under 0.4%)
    rel = np.abs(np.linalg.norm(y32 - mean, axis=-1) / np.linalg.norm(x32 - mean, axis=-1) - 1)
    assert rel.max() < (3e-3 if dtype is np.float16 or e.scales.dtype == np.uint8 else 1e-3)
    cos = np.sum(x32 * y32, axis=-1) / (np.linalg.norm(x32, axis=-1) * np.linalg.norm(y32, axis=-1))
    assert cos.mean() >= {2: 0.93, 3: 0.98, 4: 0.995, 8: 0.9999}[bits]


@pytest.mark.parametrize("bits", tq.BITS)
@pytest.mark.parametrize("rows", [1, 8, 31, 32, 64, 256])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_payload_never_exceeds_affine_quantization_at_the_same_bits(bits, rows, d):
    """The comparison the issue sets: tq at b bits against mlx's q at b bits, on no more bytes, for plain
    rows and for rows as blocks centre them (from CENTER_MIN_ROWS up)."""
    import mlx.core as mx

    from cluster.kvcache.payload_codec import centred

    x = vectors((8, rows, d))
    w, s, b = mx.quantize(mx.array(x).astype(mx.float16), group_size=64, bits=bits)
    affine = w.nbytes + s.nbytes + b.nbytes
    for center in {False, centred(x.shape, bits)}:
        e = tq.encode(x, bits, SEED, center=center)
        assert e.nbytes == sum(int(np.prod(shape)) * np.dtype(t).itemsize for t, shape in tq.arrays(x.shape, bits, center))
        assert e.nbytes <= affine, (center, e.nbytes, affine)
    assert tq.extra_coordinates(rows, d, 8, True) == 0


def test_what_the_spare_bits_buy_at_tq4_in_a_64_token_block():
    assert tq.extra_coordinates(64, 64, 4, True) == 15 and tq.extra_coordinates(64, 128, 4, True) == 39


def attention_error(k, v, kk, vv) -> float:
    def att(k, v):
        s = k @ np.swapaxes(k, -1, -2) / np.sqrt(k.shape[-1])
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        return (p / p.sum(axis=-1, keepdims=True)) @ v
    ref = att(k, v)
    return float(np.linalg.norm(att(kk, vv) - ref) / np.linalg.norm(ref))


def test_centring_and_the_norm_preserving_scale_cut_the_attention_error():
    """Rows of one head share a common part (here a third of their norm); softmax ignores a shift shared by
    all keys, so quantizing only the residual, at exact norms, gives a truer attention output."""
    rng = np.random.default_rng(7)
    k = (rng.standard_normal((4, 1, 128)) * 2 + rng.standard_normal((4, 64, 128))).astype(np.float32)
    v = (rng.standard_normal((4, 1, 128)) * 2 + rng.standard_normal((4, 64, 128))).astype(np.float32)

    def error(center):
        return attention_error(k, v, *(tq.decode(tq.encode(a, 4, SEED, center=center), SEED) for a in (k, v)))

    def shrunk():  # the paper's plain MSE decode: x_hat = ||x|| * R^T c[idx]
        out = []
        for a in (k, v):
            n = np.linalg.norm(a, axis=-1, keepdims=True)
            idx = tq.nearest(tq.rotate(a / n, SEED), 128, 4)
            out.append(tq.unrotate(tq.codebook(128, 4)[idx], SEED) * n)
        return attention_error(k, v, *out)

    assert error(True) < 0.8 * error(False) < 0.8 * shrunk()


@pytest.mark.parametrize("center", [False, True])
def test_a_zero_vector_stays_zero(center):
    x = vectors((2, 64, 128))
    x[0, 5] = 0.0
    x[1] = 0.0
    y = tq.decode(tq.encode(x, 4, SEED, center=center), SEED)
    assert np.array_equal(y[1], x[1])
    if not center:  # centred, row 5 is the mean's negation, coded like any other row
        assert np.array_equal(y[0, 5], x[0, 5])


def digest_of_an_encoding() -> str:
    h = hashlib.sha256()
    for bits in tq.BITS:
        e = tq.encode(vectors(), bits, SEED, center=True)
        for a in e.arrays():
            h.update(a.tobytes())
    return h.hexdigest()


def test_the_encoding_is_identical_in_another_process():
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from test_turboquant import digest_of_an_encoding as d; print(d())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == digest_of_an_encoding()


def test_what_it_cannot_encode_is_refused_by_name():
    with pytest.raises(ValueError, match="power-of-two head dim"):
        tq.encode(vectors((2, 80)), 4, SEED)
    with pytest.raises(ValueError, match="bits must be one of"):
        tq.encode(vectors((2, 64)), 5, SEED)
    assert not tq.supports(80) and tq.supports(64)


@pytest.mark.parametrize("d", [64, 128])
def test_tq4_beats_affine_q4_on_attention_output_at_no_more_bytes(d):
    """The issue's target on K/V shaped like a block of one model's heads: rows sharing a common part, and
    a few key channels far larger than the rest."""
    import mlx.core as mx

    rng = np.random.default_rng(d)
    k = (rng.standard_normal((8, 1, d)) + rng.standard_normal((8, 64, d))).astype(np.float32)
    k[..., rng.choice(d, 4, replace=False)] *= 8.0
    v = (rng.standard_normal((8, 1, d)) + rng.standard_normal((8, 64, d))).astype(np.float32)

    def affine(a):
        w, s, b = mx.quantize(mx.array(a).astype(mx.float16), group_size=64, bits=4)
        return np.array(mx.dequantize(w, s, b, group_size=64, bits=4).astype(mx.float32)), w.nbytes + s.nbytes + b.nbytes

    (kq, kq_bytes), (vq, vq_bytes) = affine(k), affine(v)
    ek, ev = (tq.encode(a, 4, SEED, center=True) for a in (k, v))
    assert ek.nbytes + ev.nbytes <= kq_bytes + vq_bytes
    tq_error = attention_error(k, v, tq.decode(ek, SEED), tq.decode(ev, SEED))
    assert tq_error < 0.95 * attention_error(k, v, kq, vq)
