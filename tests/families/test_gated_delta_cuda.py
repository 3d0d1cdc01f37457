"""The gated-delta kernel for CUDA: mlx-lm's recurrence, chunk- and batch-invariant, and routed to only where it applies."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as mlx_gd

from cluster.families.gated_delta_cuda import gated_delta, install, supported

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel is CUDA's (elsewhere the ops path runs)")


def inputs(B=2, T=48, Hk=2, Hv=4, Dk=64, Dv=32, dtype=mx.float32, vector_g=False, seed=0):
    """Random inputs shaped as qwen3_5's GatedDeltaNet hands them over (q, k normalized as it does)."""
    mx.random.seed(seed)
    q, k = (mx.random.normal((B, T, Hk, Dk)) for _ in range(2))
    q, k = mlx_gd.normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(0, 0.5, (B, T, Hv, Dk) if vector_g else (B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return [a.astype(dtype) for a in (q, k, v)] + [g, beta.astype(dtype), state]


def test_install_keeps_the_ops_path_where_the_kernel_does_not_apply():
    """Installed twice, one wrapper; off CUDA (or with a key head dim the kernel lacks) the original's results, bitwise."""
    install()
    install()
    wrapper = mlx_gd.gated_delta_ops
    original = wrapper._mlx_fleet_original
    assert getattr(original, "_mlx_fleet_original", None) is None
    q, k, v, g, beta, state = inputs(Dk=48) if ON_CUDA else inputs()
    assert not supported(q, v, g, state)
    for got, want in zip(wrapper(q, k, v, g, beta, state), original(q, k, v, g, beta, state)):
        assert mx.array_equal(got, want).item()


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("vector_g", [False, True])
def test_kernel_computes_mlx_lms_recurrence(dtype, vector_g):
    """Against the ops path: the same sums in another order, so within float32 rounding of the state
    (the outputs of bfloat16 inputs within one bfloat16 ulp of their magnitude)."""
    q, k, v, g, beta, state = inputs(dtype=dtype, vector_g=vector_g)
    y, s = gated_delta(q, k, v, g, beta, state)
    install()
    y_ref, s_ref = mlx_gd.gated_delta_ops._mlx_fleet_original(q, k, v, g, beta, state)
    assert y.dtype == dtype and s.dtype == mx.float32 and y.shape == y_ref.shape and s.shape == s_ref.shape
    assert mx.abs(s - s_ref).max().item() < 1e-4
    ulp = 1e-5 if dtype == mx.float32 else 2 ** -7
    scale = mx.abs(y_ref.astype(mx.float32)).max().item()
    assert mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item() <= ulp * max(scale, 1.0)


@cuda_only
def test_chunks_and_rows_are_bitwise_one_run():
    """Prefilled in two chunks (the state handed over in float32) = one run; a batch's row = the row alone."""
    q, k, v, g, beta, state = inputs(dtype=mx.bfloat16)
    y, s = gated_delta(q, k, v, g, beta, state)
    cut = 32
    y1, s1 = gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state)
    y2, s2 = gated_delta(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    assert mx.array_equal(mx.concatenate([y1, y2], axis=1), y).item() and mx.array_equal(s2, s).item()
    y_row, s_row = gated_delta(*(a[1:2] for a in (q, k, v, g, beta, state)))
    assert mx.array_equal(y_row, y[1:2]).item() and mx.array_equal(s_row, s[1:2]).item()


@cuda_only
def test_masked_steps_keep_the_state():
    """A padding step (mask false) leaves the state as it was and outputs zeros, as the Metal kernel does."""
    q, k, v, g, beta, state = inputs(B=1, T=8)
    mask = mx.array([[False, False, True, True, True, True, True, True]])
    y, s = gated_delta(q, k, v, g, beta, state, mask)
    y_live, s_live = gated_delta(q[:, 2:], k[:, 2:], v[:, 2:], g[:, 2:], beta[:, 2:], state)
    assert mx.array_equal(s, s_live).item() and mx.array_equal(y[:, 2:], y_live).item()
    assert not mx.any(y[:, :2]).item()


@cuda_only
def test_mlx_lm_calls_reach_the_kernel():
    """gated_delta_update (what every hybrid model calls) takes the kernel once installed."""
    install()
    q, k, v, _, _, state = inputs()
    a, b = mx.random.normal((2, 48, 4)), mx.random.normal((2, 48, 4))
    A_log, dt_bias = mx.random.normal((4,)), mx.random.normal((4,))
    y, s = mlx_gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    beta, g = mx.sigmoid(b), mlx_gd.compute_g(A_log, a, dt_bias)
    y_k, s_k = gated_delta(q, k, v, g, beta, state)
    assert mx.array_equal(y, y_k).item() and mx.array_equal(s, s_k).item()
