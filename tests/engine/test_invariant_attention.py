"""The batch-invariant attention (engine/invariant_attention.py) against mlx-lm's own, over its batched caches.

On CUDA this is the kernel, elsewhere the per-row reference: both must attend to exactly the keys mlx-lm's
mask lets each row see (a full cache's left-padded rows, a rotating cache's window after it wrapped, rows
that joined by `extend`), and give a row bitwise the same result alone as beside any other rows, in a
buffer of any length (several of the kernel's 256-key chunks, or one).
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from cluster.engine import invariant_attention
from cluster.engine.invariant_attention import CHUNK, attention, rows_of
from cluster.engine.scheduler import Scheduler

H, G = 2, 2
# float32: the same keys summed in another order (over at most 700), a few ulps of values near 1.
F32_TOLERANCE = 1e-5
LENGTHS = [40, 700, 7, 300]  # up to three of the kernel's chunks; one row shorter than one


@pytest.fixture(scope="module")
def run():
    s = Scheduler(name="mlx-fleet-test")
    yield s.run
    s.stop()


def filled(cls, n: int, seed: int, D: int, dtype, **kw):
    cache = cls(**kw)
    mx.random.seed(seed)
    for s in range(0, n, 64):
        L = min(64, n - s)
        cache.update_and_fetch(mx.random.normal((1, H, L, D)).astype(dtype), mx.random.normal((1, H, L, D)).astype(dtype))
    return cache


def step(batch, rows: int, D: int, dtype, seed: int = 9):
    """One decode step's new keys into `batch`; (queries, keys, values, mlx-lm's mask) for it."""
    mx.random.seed(seed)
    k, v = (mx.random.normal((rows, H, 1, D)).astype(dtype) for _ in range(2))
    q = mx.random.normal((rows, H * G, 1, D)).astype(dtype)
    mask = batch.make_mask(1, window_size=getattr(batch, "max_size", None), return_array=True)
    keys, values = batch.update_and_fetch(k, v)
    return q, keys, values, mask


CACHES = [(KVCache, {}), (RotatingKVCache, {"max_size": 64})]


@pytest.mark.parametrize("cls,kw", CACHES, ids=["full", "rotating"])
@pytest.mark.parametrize("D", [64, 128, 512])  # 512: Gemma 4's global layers
def test_each_row_attends_to_the_keys_mlx_lm_lets_it_see(run, cls, kw, D):
    def go():
        batch = cls.merge([filled(cls, n, i, D, mx.float32, **kw) for i, n in enumerate(LENGTHS)])
        gaps = []
        for t in range(3):  # a rotating cache wraps as it goes
            q, keys, values, mask = step(batch, len(LENGTHS), D, mx.float32, seed=t)
            theirs = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=mask)
            count, end = rows_of(batch, keys)
            ours = attention(q, keys, values, D ** -0.5, count, end)
            shifted = attention(q, keys, values, D ** -0.5, count, end - 1)  # the negative control: one key off
            gaps.append((mx.abs(ours - theirs).max().item(), mx.abs(shifted - theirs).max().item()))
        return gaps
    gaps = run(go)
    assert max(g for g, _ in gaps) <= F32_TOLERANCE and min(wrong for _, wrong in gaps) > 1e-2, gaps


@pytest.mark.parametrize("cls,kw", CACHES, ids=["full", "rotating"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_alone_is_bitwise_the_row_beside_others(run, cls, kw, dtype):
    dt = getattr(mx, dtype)

    def go():
        batch = cls.merge([filled(cls, n, i, 128, dt, **kw) for i, n in enumerate(LENGTHS)])
        q, keys, values, _ = step(batch, len(LENGTHS), 128, dt)
        together = attention(q, keys, values, 128 ** -0.5, *rows_of(batch, keys))
        same = []
        for i, n in enumerate(LENGTHS):
            alone = cls.merge([filled(cls, n, i, 128, dt, **kw)])
            mx.random.seed(9)
            k, v = (mx.random.normal((len(LENGTHS), H, 1, 128)).astype(dt) for _ in range(2))
            k1, v1 = alone.update_and_fetch(k[i:i + 1], v[i:i + 1])
            one = attention(q[i:i + 1], k1, v1, 128 ** -0.5, *rows_of(alone, k1))
            same.append((k1.shape[2] < keys.shape[2] or cls is RotatingKVCache, mx.array_equal(one[0], together[i]).item()))
        return keys.shape[2], same
    length, same = run(go)
    assert cls is RotatingKVCache or length > 2 * CHUNK  # the batch's buffer spans chunks the short rows' do not
    assert [s for _, s in same] == [True] * len(LENGTHS)


def test_a_row_with_no_keys_attends_to_nothing(run):
    def go():
        q, k, v = mx.ones((2, 4, 1, 64)), mx.ones((2, 2, 300, 64)), mx.ones((2, 2, 300, 64))
        out = attention(q, k, v, 0.125, mx.array([0, 300]), 300)
        return out[0].abs().max().item(), mx.allclose(out[1], mx.ones((4, 1, 64))).item()
    assert run(go) == (0.0, True)


@pytest.mark.parametrize("cls,kw", CACHES, ids=["full", "rotating"])
def test_one_sequences_cache_is_read_in_order_as_mlx_lm_attends_and_bitwise_a_batchs_row(run, cls, kw):
    """rows_of on one sequence's cache (what a decode step alone and a prompt's last token see, routed to the
    kernel on CUDA): the result is mlx-lm's over the keys it returns, step after step (a rotating cache's
    slice before its ring wraps, the ring after, its newest key anywhere in it), bitwise the same row's in a
    batch, and one key fewer is not."""
    def go():
        out = []
        for n in (40, 63, 64, 70, 300):  # a window of 64: before, at and after it wraps
            alone, batch = filled(cls, n, 3, 64, mx.float32, **kw), cls.merge([filled(cls, n, 3, 64, mx.float32, **kw)])
            for t in range(5):
                mx.random.seed(5 + t)
                k, v, q = mx.random.normal((1, H, 1, 64)), mx.random.normal((1, H, 1, 64)), mx.random.normal((1, H * G, 1, 64))
                keys, values = alone.update_and_fetch(k, v)
                count, end = rows_of(alone, keys)
                mine = attention(q, keys, values, 0.125, count, end)
                truth = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)  # mlx-lm's, no mask
                bk, bv = batch.update_and_fetch(k, v)
                theirs = attention(q, bk, bv, 0.125, *rows_of(batch, bk))
                fewer = attention(q, keys, values, 0.125, count - 1, end)  # the negative control: the oldest key left out
                out.append((n + t + 1, count.tolist()[0], mx.abs(mine - truth).max().item(),
                            mx.array_equal(mine, theirs).item(), mx.abs(fewer - truth).max().item()))
        return out
    got = run(go)
    assert [c for _, c, *_ in got] == [min(total, 64) if cls is RotatingKVCache else total for total, *_ in got]
    assert max(gap for _, _, gap, _, _ in got) <= F32_TOLERANCE, got
    assert all(same for *_, same, _ in got) and min(wrong for *_, wrong in got) > 1e-3, got


def test_the_kernel_takes_the_shapes_its_block_holds():
    """Head dims up to 512 and grouped heads whose outputs fit a block's 48 KB of shared memory: Qwen3.5's and
    Qwen3-Next's 16 query / 2 KV heads of 256 (the kernel's first version asked 66 KB for them, which ptxas
    refused: checked with NVRTC for sm_90, docs/gpu.md) and Gemma 4's global layers (512); a wider head or a
    larger group stays mlx-lm's."""
    def shapes(hq, hk, d):
        return mx.zeros((1, hq, 1, d)), mx.zeros((1, hk, 8, d)), mx.zeros((1, hk, 8, d))

    assert invariant_attention.supports(*shapes(32, 8, 128))  # Qwen3-8B
    assert invariant_attention.supports(*shapes(16, 2, 256))  # Qwen3.5 / Qwen3-Next full attention
    assert invariant_attention.supports(*shapes(40, 1, 256))  # (2 * 8 * 40 + 40 * 256) * 4 = 43,520 bytes
    assert not invariant_attention.supports(*shapes(64, 1, 256))  # 69,632 bytes
    assert invariant_attention.supports(*shapes(32, 4, 512))  # Gemma 4 31B's global layers
    assert not invariant_attention.supports(*shapes(64, 2, 512))  # (2 * 8 * 32 + 32 * 512) * 4 = 67,584 bytes
    assert not invariant_attention.supports(*shapes(4, 4, 1024))  # wider than MAX_HEAD_DIM
    assert not invariant_attention.supports(*shapes(12, 8, 128))  # not grouped evenly
