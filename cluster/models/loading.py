"""Loading a model for this process: mlx-lm's `load`, with this backend's kernels in place first.

Every path that runs a model (a replica, a sharded replica's rank, a benchmark, the tests) loads it
here, so a cold run and a cached one always compute with the same kernels.
"""

from __future__ import annotations


def load_model(path, lazy: bool = False):
    """(model, tokenizer) from a resolved model directory."""
    from mlx_lm import load

    from cluster.engine.schedule import cuda
    from cluster.kernels.gated_delta_cuda import install

    install()  # hybrids' recurrence in a kernel on CUDA (mlx-lm has one for Metal only)
    loaded = load(str(path), lazy=lazy)
    if cuda():  # one-query attention in a kernel that repeats itself (engine/invariant.py says why)
        from cluster.engine import invariant

        invariant.exact_decode_attention()
    return loaded

