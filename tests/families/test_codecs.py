"""Every layer kind cut into blocks and rebuilt holds exactly the state a cold prefill leaves."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from cluster.families.codecs import RestoreError, capture_block, capture_state, new_cache, restore_entry
from cluster.families.specs import FullAttention, QuantizedAttention, Recurrent, SlidingWindow

B = 16


def filled(spec, tokens: int, chunk: int = 32):
    """A cache after prefilling `tokens` random K/V in block-aligned chunks (as the engine does)."""
    cache = new_cache(spec)
    mx.random.seed(3)
    for start in range(0, tokens, chunk):
        s = min(chunk, tokens - start)
        k = mx.random.normal((1, 2, s, 64))
        cache.update_and_fetch(k, k * 2)
    return cache


def temporal(cache):
    keys = cache._temporal_order(cache.keys) if isinstance(cache, RotatingKVCache) else cache.keys
    return keys[..., : cache.keys.shape[2] if isinstance(cache, RotatingKVCache) else cache.offset, :]


@pytest.mark.parametrize("n", [16, 37, 64, 100])
def test_full_attention_round_trip(n):
    spec = FullAttention()
    cache = filled(spec, 112)
    parts = [capture_block(spec, cache, j * B, (j + 1) * B, B) for j in range(112 // B)]
    out = restore_entry(spec, parts, n, B, capacity=256)
    assert isinstance(out, KVCache) and out.offset == n and out.keys.shape[2] == out.values.shape[2] == 256
    assert mx.array_equal(out.keys[..., :n, :], cache.keys[..., :n, :])
    assert mx.array_equal(out.values[..., :n, :], cache.values[..., :n, :])


def test_quantized_round_trip():
    spec = QuantizedAttention(8, 64)
    cache = filled(spec, 96)
    parts = [capture_block(spec, cache, j * B, (j + 1) * B, B) for j in range(6)]
    assert len(parts[0]) == 6  # packed, scales, biases for K and V
    out = restore_entry(spec, parts, 80, B, capacity=256)
    assert isinstance(out, QuantizedKVCache) and out.offset == 80 and (out.bits, out.group_size) == (8, 64)
    assert all(a.shape[2] == 256 for a in (*out.keys, *out.values))
    for got, want in zip((*out.keys, *out.values), (*cache.keys, *cache.values)):
        assert mx.array_equal(got[..., :80, :], want[..., :80, :])


@pytest.mark.parametrize("window,n", [(24, 48), (24, 64), (64, 96), (64, 50)])
def test_sliding_round_trip_holds_the_window_in_order(window, n):
    spec = SlidingWindow(window)
    cache = new_cache(spec)
    parts = []
    mx.random.seed(5)
    full = mx.random.normal((1, 2, 128, 64))
    for j in range(128 // B):  # capture each block right after the chunk that made it
        cache.update_and_fetch(full[..., j * B:(j + 1) * B, :], full[..., j * B:(j + 1) * B, :] + 1)
        parts.append(capture_block(spec, cache, j * B, (j + 1) * B, B))
    out = restore_entry(spec, parts, n, B, capacity=256)
    lo = max(0, n - window)
    assert isinstance(out, RotatingKVCache) and out.offset == n and out._idx == n - lo
    assert mx.array_equal(out.keys, full[..., lo:n, :])


def test_sliding_capture_after_decode_wraparound():
    spec = SlidingWindow(24)
    cache = new_cache(spec)
    mx.random.seed(7)
    full = mx.random.normal((1, 2, 80, 64))
    cache.update_and_fetch(full[..., :10, :], full[..., :10, :])
    for t in range(10, 80):  # single-token steps: the ring rotates in place
        cache.update_and_fetch(full[..., t:t + 1, :], full[..., t:t + 1, :])
        if (t + 1) % B == 0:
            k, _ = capture_block(spec, cache, t + 1 - B, t + 1, B)
            assert mx.array_equal(k, full[..., t + 1 - B:t + 1, :])


def test_recurrent_restores_only_its_own_checkpoint():
    spec = Recurrent(2)
    cache = new_cache(spec)
    cache[0], cache[1] = mx.ones((1, 3, 8)), mx.zeros((1, 2, 4, 4))
    state = capture_state(spec, cache)
    out = restore_entry(spec, [], 64, B, capacity=256, state=state)
    assert all(mx.array_equal(a, b) for a, b in zip(out.cache, cache.cache))
    with pytest.raises(RestoreError):
        restore_entry(spec, [], 64, B, capacity=256, state=None)


def test_missing_block_is_an_error_not_a_short_cache():
    spec = FullAttention()
    cache = filled(spec, 64)
    parts = [capture_block(spec, cache, j * B, (j + 1) * B, B) for j in range(4)]
    parts[2] = None
    with pytest.raises(RestoreError):
        restore_entry(spec, parts, 60, B, capacity=256)
