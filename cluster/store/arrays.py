"""mx.array <-> (dtype tag, numpy array) for the block format.

numpy has no bfloat16, so those bytes travel as uint16 and are viewed back.
Going to numpy copies nothing: the result is a (possibly strided) view of the
evaluated MLX buffer, which the encoder copies once into the envelope. Coming
back is one copy into MLX memory, from a view of the block's bytes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cluster.store.block_format import Tagged

AS_BITS = {mx.bfloat16: mx.uint16}  # dtypes numpy lacks, by the unsigned ints holding their bits


def dtype_tag(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def host_views(arrays: list[mx.array]) -> list[Tagged]:
    """Evaluate `arrays` together (one sync) and view each from numpy."""
    bits = [a.view(AS_BITS[a.dtype]) if a.dtype in AS_BITS else a for a in arrays]
    mx.eval(bits)
    return [(dtype_tag(a.dtype), np.asarray(b)) for a, b in zip(arrays, bits)]



def to_mlx(tagged: Tagged) -> mx.array:
    tag, data = tagged
    out = mx.array(data)
    dtype = getattr(mx, tag)
    return out.view(dtype) if out.dtype != dtype else out
