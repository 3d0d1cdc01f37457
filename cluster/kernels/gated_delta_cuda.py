"""The gated-delta recurrence of hybrid models (Qwen3.5, Qwen3-Next) in a CUDA kernel.

mlx-lm runs this recurrence in a Metal kernel on a Mac. Everywhere else it falls back to
`gated_delta_ops`: a Python loop over the prompt's tokens, a few MLX ops per token and layer. On
MLX's CUDA backend that made a cold 8k-token prefill of the Qwen3-Next shape take 25.5 s on an
H100 (docs/gpu.md), against 0.32 s for the dense 8B shape: every hybrid figure measured there was
the loop's, not the cache's or the GPU's.

This is the Metal kernel's algorithm in CUDA: one warp per (sequence, value head, value row), each
lane keeping Dk / 32 of the row's state in registers, the tokens in order. `install` points mlx-lm's
fallback at it on CUDA (every model module calls `gated_delta_update`, which looks the fallback up
at call time), and leaves the ops path to what the kernel does not cover: other backends, a key
head dim that is not a multiple of 32, no state given.

It covers every mlx-lm model that calls `gated_delta_update` (qwen3_5, qwen3_next, kimi_linear, kimi_k3,
olmo_hybrid, bailing_moe_v3); the fallback stays for other backends, a key head dim that is not a multiple
of 32 or above MAX_DK, value heads that are not a multiple of the key heads, arguments not shaped as the
kernel reads them, and no state given. It has no gradient: a process that trains a hybrid on CUDA (mlx-lm
passes `use_kernel=False` then, which this fallback cannot see) must not load its model through
models/loading.py.

Exactness: each (sequence, head, row) is computed alone, in token order, from the state handed in.
So a prompt prefilled in chunks, or resumed from a checkpoint taken at a chunk's end, gives bitwise
what one uninterrupted run of the same chunks gives, and a batched row what the row gives alone. Its
sums are not the ops path's (a warp's tree against a row's reduction), so blocks made with it must never
meet blocks made without it: `VERSION` is part of the fingerprint of every hybrid's blocks made on CUDA
(kvcache/setup.py), and changes whenever the kernel's arithmetic does.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

VERSION = "gated-delta-cuda/1"  # in the fingerprint of a CUDA hybrid's blocks: bump when the arithmetic changes
MAX_DK = 32 * 8  # registers per lane: Dk / 32 floats of state

_SOURCE = r"""
    // grid (32, Dv, B * Hv): one warp per value row dv of sequence b's value head hv.
    constexpr int NPT = Dk / 32;
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    const int T = q_shape[1];
    const int b = n / Hv, hv = n % Hv, hk = hv / (Hv / Hk);

    const auto* q_ = q + ((size_t)b * T * Hk + hk) * Dk;      // q, k: [B, T, Hk, Dk]
    const auto* k_ = k + ((size_t)b * T * Hk + hk) * Dk;
    const auto* v_ = v + ((size_t)b * T * Hv + hv) * Dv;      // v, y: [B, T, Hv, Dv]
    auto* y_ = y + ((size_t)b * T * Hv + hv) * Dv;
    const auto* beta_ = beta + (size_t)b * T * Hv;            // beta: [B, T, Hv]
#if VECTOR_G
    const auto* g_ = g + ((size_t)b * T * Hv + hv) * Dk;      // g: [B, T, Hv, Dk]
#else
    const auto* g_ = g + (size_t)b * T * Hv;                  // g: [B, T, Hv]
#endif
    const size_t row = ((size_t)n * Dv + dv) * Dk;            // state: [B, Hv, Dv, Dk]

    float s[NPT];
    for (int i = 0; i < NPT; ++i) s[i] = static_cast<float>(state_in[row + NPT * lane + i]);

    for (int t = 0; t < T; ++t) {
#if MASKED
        const bool live = mask[(size_t)b * T + t];
#else
        const bool live = true;
#endif
        if (live) {
            float kv = 0.f;
            for (int i = 0; i < NPT; ++i) {
                const int d = NPT * lane + i;
#if VECTOR_G
                s[i] = s[i] * static_cast<float>(g_[d]);
#else
                s[i] = s[i] * static_cast<float>(g_[hv]);
#endif
                kv += s[i] * static_cast<float>(k_[d]);
            }
            for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffff, kv, o);
            const float delta = (static_cast<float>(v_[dv]) - kv) * static_cast<float>(beta_[hv]);
            float out = 0.f;
            for (int i = 0; i < NPT; ++i) {
                const int d = NPT * lane + i;
                s[i] = s[i] + static_cast<float>(k_[d]) * delta;
                out += s[i] * static_cast<float>(q_[d]);
            }
            for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
            if (lane == 0) y_[dv] = static_cast<InT>(out);
        } else if (lane == 0) {
            y_[dv] = static_cast<InT>(0.f);
        }
        q_ += Hk * Dk;
        k_ += Hk * Dk;
        v_ += Hv * Dv;
        y_ += Hv * Dv;
        beta_ += Hv;
#if VECTOR_G
        g_ += Hv * Dk;
#else
        g_ += Hv;
#endif
    }
    for (int i = 0; i < NPT; ++i) state_out[row + NPT * lane + i] = static_cast<StT>(s[i]);
"""

_kernels: dict[tuple[bool, bool], object] = {}
# MLX caches a compiled custom kernel by its name and template arguments: the name carries the source's
# digest (an edited kernel never meets a stale build), the template every input's dtype (the generated
# signature takes them from the inputs: beta is float32 in one model and bfloat16 in another).
_DIGEST = hashlib.blake2b(_SOURCE.encode(), digest_size=6).hexdigest()


def _kernel(vector_g: bool, masked: bool):
    key = (vector_g, masked)
    if key not in _kernels:
        names = ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])
        header = f"#define VECTOR_G {int(vector_g)}\n#define MASKED {int(masked)}\n"
        _kernels[key] = mx.fast.cuda_kernel(f"mlx_fleet_gated_delta_{_DIGEST}_{int(vector_g)}{int(masked)}", names,
                                            ["y", "state_out"], _SOURCE, header=header)
    return _kernels[key]


def on_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def supported(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state, mask=None) -> bool:
    """Whether the kernel covers this call: CUDA, a key head dim of 32k <= MAX_DK, value heads a multiple of the
    key heads, a state handed in, and every argument shaped exactly as the kernel reads it (no broadcasting)."""
    if state is None or not on_cuda() or q.ndim != 4 or v.ndim != 4:
        return False
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    return (Dk % 32 == 0 and Dk <= MAX_DK and Hv % Hk == 0 and k.shape == q.shape and v.shape[:2] == (B, T)
            and g.shape in ((B, T, Hv), (B, T, Hv, Dk)) and beta.shape == (B, T, Hv)
            and state.shape == (B, Hv, Dv, Dk) and (mask is None or mask.shape == (B, T)))


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                mask=None) -> tuple[mx.array, mx.array]:
    """(y [B, T, Hv, Dv], the state after the last token), as `gated_delta_ops` computes them, except at a masked
    (padding) step: y is 0 there, as mlx-lm's Metal kernel gives it (the ops path computes it and drops it)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    inputs = [q, k, v, g, beta, state] + ([mask] if mask is not None else [])
    rows = 4 if Dv % 4 == 0 else 1
    y, out = _kernel(g.ndim == 4, mask is not None)(
        inputs=inputs,
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("KT", k.dtype), ("VT", v.dtype), ("GT", g.dtype), ("BT", beta.dtype)]
        + ([("MT", mask.dtype)] if mask is not None else []),
        grid=(32, Dv, B * Hv), threadgroup=(32, rows, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype])
    return y, out


def install() -> None:
    """Route mlx-lm's gated-delta fallback to the kernel where it applies (idempotent; any backend: the
    choice is made per call, so a process that never runs on CUDA keeps the ops path)."""
    from mlx_lm.models import gated_delta as module

    if getattr(module.gated_delta_ops, "_mlx_fleet_original", None) is not None:
        return
    original = module.gated_delta_ops

    def gated_delta_ops(q, k, v, g, beta, state=None, mask=None):
        if supported(q, k, v, g, beta, state, mask):
            return gated_delta(q, k, v, g, beta, state, mask)
        return original(q, k, v, g, beta, state, mask)

    gated_delta_ops._mlx_fleet_original = original
    module.gated_delta_ops = gated_delta_ops


def in_effect() -> bool:
    """Whether this process computes hybrids' recurrence with the kernel (installed, on CUDA)."""
    from mlx_lm.models import gated_delta as module

    return on_cuda() and getattr(module.gated_delta_ops, "_mlx_fleet_original", None) is not None
