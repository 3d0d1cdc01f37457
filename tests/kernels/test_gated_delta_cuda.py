"""The gated-delta kernel for CUDA: mlx-lm's recurrence, chunk- and batch-invariant, and routed to only where it applies."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as mlx_gd

from cluster.kernels import gated_delta_cuda
from cluster.kernels.gated_delta_cuda import gated_delta, install, supported

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel is CUDA's (elsewhere the ops path runs)")


def inputs(B=2, T=48, Hk=2, Hv=4, Dk=64, Dv=32, dtype=mx.float32, vector_g=False, seed=0, beta_dtype=None,
           state_dtype=mx.float32):
    """Random inputs shaped as qwen3_5's GatedDeltaNet hands them over (q, k normalized as it does); beta in
    `beta_dtype` (bailing_moe_v3's is float32 whatever the model's), the state in `state_dtype`."""
    mx.random.seed(seed)
    q, k = (mx.random.normal((B, T, Hk, Dk)) for _ in range(2))
    q, k = mlx_gd.normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(0, 0.5, (B, T, Hv, Dk) if vector_g else (B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return [a.astype(dtype) for a in (q, k, v)] + [g, beta.astype(beta_dtype or dtype), state.astype(state_dtype)]


def test_install_keeps_the_ops_path_where_the_kernel_does_not_apply():
    """Installed twice, one wrapper; off CUDA (or with a key head dim the kernel lacks) the original's results, bitwise."""
    install()
    install()
    wrapper = mlx_gd.gated_delta_ops
    original = wrapper._mlx_fleet_original
    assert getattr(original, "_mlx_fleet_original", None) is None
    q, k, v, g, beta, state = inputs(Dk=48) if ON_CUDA else inputs()
    assert not supported(q, k, v, g, beta, state)
    for got, want in zip(wrapper(q, k, v, g, beta, state), original(q, k, v, g, beta, state)):
        assert mx.array_equal(got, want).item()


def test_only_arguments_shaped_as_the_kernel_reads_them_reach_it(monkeypatch):
    """A broadcast gate, a mask of another shape, a head dim the lanes cannot split: the ops path, never the kernel."""
    monkeypatch.setattr(gated_delta_cuda, "on_cuda", lambda: True)
    q, k, v, g, beta, state = inputs()
    assert supported(q, k, v, g, beta, state) and supported(q, k, v, g, beta, state, mx.ones((2, 48), mx.bool_))
    assert not supported(q, k, v, g[..., :1], beta, state)  # [B, T, 1]: broadcast over the heads
    assert not supported(q, k, v, g, beta, state, mx.ones((2, 1), mx.bool_))
    assert not supported(q, k, v, g, beta, None)
    assert not supported(*inputs(Dk=48))
    assert not supported(*inputs(Hk=3, Hv=4))
    assert not supported(*inputs(Dk=512))


def test_the_kernel_names_the_blocks_only_where_it_computes_them():
    """Off CUDA no kernel of ours computes a cache, so no fingerprint carries one (kvcache/setup.py); on CUDA the
    recurrence's (hybrids) and the one-query attention's (every model, once one is loaded: engine/invariant.py)."""
    from cluster.engine import invariant
    from cluster.families.specs import FullAttention, Layout, Recurrent
    from cluster.kvcache.setup import kernels_in_effect

    install()
    assert gated_delta_cuda.in_effect() == ON_CUDA
    hybrid, dense = Layout("qwen3_5", (Recurrent(2), FullAttention())), Layout("qwen3", (FullAttention(),))
    exact = [invariant.EXACT_DECODE_VERSION] if invariant.routes_one_query() else []  # on CUDA once a model loads
    assert kernels_in_effect(hybrid) == ([gated_delta_cuda.VERSION] if ON_CUDA else []) + exact
    assert kernels_in_effect(dense) == exact


SHAPES = [dict(), dict(Dk=128, Dv=128, Hk=2, Hv=4), dict(Hk=4, Hv=4), dict(Dv=6), dict(Dk=256, Dv=8, Hk=1, Hv=2)]


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("vector_g", [False, True])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_kernel_computes_mlx_lms_recurrence(dtype, vector_g, shape):
    """Against the ops path: the same sums in another order, so within float32 rounding of the state
    (the outputs of bfloat16 inputs within one bfloat16 ulp of their magnitude)."""
    q, k, v, g, beta, state = inputs(dtype=dtype, vector_g=vector_g, **SHAPES[shape])
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


@cuda_only
def test_other_input_dtypes_get_kernels_of_their_own():
    """beta in float32 beside bfloat16 q (bailing_moe_v3), then in bfloat16, a bfloat16 state: each as the ops
    path computes it (MLX caches a kernel by name and template: the dtypes are in the template)."""
    install()
    original = mlx_gd.gated_delta_ops._mlx_fleet_original
    for kw in (dict(beta_dtype=mx.float32), dict(), dict(state_dtype=mx.bfloat16), dict(vector_g=True)):
        q, k, v, g, beta, state = inputs(dtype=mx.bfloat16, **kw)
        y, s = gated_delta(q, k, v, g, beta, state)
        y_ref, s_ref = original(q, k, v, g, beta, state)
        assert s.dtype == state.dtype
        assert within_a_bf16_ulp(s, s_ref) and within_a_bf16_ulp(y, y_ref), kw


def within_a_bf16_ulp(got: mx.array, want: mx.array) -> bool:
    """At most one bfloat16 ulp (2^-7 relative) of the largest magnitude apart: both sides are float32 sums
    rounded once to bfloat16 at the end, in other orders."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return mx.abs(got - want).max().item() <= 2 ** -7 * max(mx.abs(want).max().item(), 1.0)


@cuda_only
def test_masked_steps_with_a_vector_gate_keep_the_state():
    q, k, v, g, beta, state = inputs(B=1, T=8, vector_g=True)
    mask = mx.array([[False, True, True, True, True, True, True, True]])
    y, s = gated_delta(q, k, v, g, beta, state, mask)
    y_live, s_live = gated_delta(q[:, 1:], k[:, 1:], v[:, 1:], g[:, 1:], beta[:, 1:], state)
    assert mx.array_equal(s, s_live).item() and mx.array_equal(y[:, 1:], y_live).item()
