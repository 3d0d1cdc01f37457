"""mx.array <-> (dtype tag, numpy array) for the block format.

numpy has no bfloat16, so those bytes travel as uint16 and are viewed back.
Going to numpy forces evaluation and makes one contiguous copy; coming back is
one copy into MLX memory (from a view of the block's bytes).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cluster.store.block_format import Tagged

_AS_BITS = {mx.bfloat16: mx.uint16}


def dtype_tag(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def to_numpy(a: mx.array) -> Tagged:
    tag = dtype_tag(a.dtype)
    bits = a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a
    return tag, np.array(bits, copy=True)


def to_mlx(tagged: Tagged) -> mx.array:
    tag, data = tagged
    out = mx.array(data)
    dtype = getattr(mx, tag)
    return out.view(dtype) if out.dtype != dtype else out
