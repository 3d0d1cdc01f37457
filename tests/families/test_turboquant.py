"""TurboQuant core: an orthonormal seeded rotation, Lloyd-Max codebooks at the paper's distortion, exact packing."""

import hashlib
import subprocess
import sys

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
    unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
    mse = float(np.mean(np.sum((tq.decode(tq.encode(unit, bits, SEED), SEED) - unit) ** 2, axis=-1)))
    assert 4.0 ** -bits <= mse <= 2.72 * 4.0 ** -bits  # the lower bound and Panter-Dite's upper one
    assert mse == pytest.approx(PAPER_MSE[bits], rel=0.06)


@pytest.mark.parametrize("bits", tq.BITS)
@pytest.mark.parametrize("count", [1, 7, 8, 1000])
def test_packing_round_trips_any_count(bits, count):
    idx = np.random.default_rng(count).integers(0, 1 << bits, size=count, dtype=np.uint8)
    packed = tq.pack(idx, bits)
    assert packed.dtype == np.uint8 and packed.nbytes == -(-count * bits // 8)
    assert np.array_equal(tq.unpack(packed, bits, count), idx)


@pytest.mark.parametrize("bits", tq.BITS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_round_trip_keeps_shape_dtype_and_norms(bits, dtype):
    x = vectors().astype(dtype)
    e = tq.encode(x, bits, SEED)
    y = tq.decode(e, SEED)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert np.array_equal(e.norms, np.linalg.norm(x.astype(np.float32), axis=-1).astype(np.float32))
    rel = np.abs(np.linalg.norm(y.astype(np.float32), axis=-1) / e.norms - 1)
    assert rel.mean() < 4 * 2.0 ** -bits
    cos = np.sum(x.astype(np.float32) * y, axis=-1) / (e.norms * np.linalg.norm(y.astype(np.float32), axis=-1))
    assert cos.mean() >= {2: 0.93, 3: 0.98, 4: 0.995, 8: 0.9999}[bits]


def test_a_zero_vector_stays_zero():
    x = np.zeros((2, 128), dtype=np.float32)
    assert np.array_equal(tq.decode(tq.encode(x, 4, SEED), SEED), x)


def digest_of_an_encoding() -> str:
    e = tq.encode(vectors(), 3, SEED)
    return hashlib.sha256(e.packed.tobytes() + e.norms.tobytes()).hexdigest()


def test_the_encoding_is_identical_in_another_process():
    code = ("import sys; sys.path.insert(0, 'tests/families'); "
            "from test_turboquant import digest_of_an_encoding as d; print(d())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == digest_of_an_encoding()


def test_what_it_cannot_encode_is_refused_by_name():
    with pytest.raises(ValueError, match="power-of-two head dim"):
        tq.encode(vectors((2, 80)), 4, SEED)
    with pytest.raises(ValueError, match="bits must be one of"):
        tq.encode(vectors((2, 64)), 5, SEED)
    assert not tq.supports(80) and tq.supports(64)
