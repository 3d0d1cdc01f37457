"""model_type -> layout function, and the check that the layout matches mlx-lm's caches."""

from __future__ import annotations

from typing import Callable

from cluster.families import dense, gemma, qwen_hybrid
from cluster.families.specs import FullAttention, Layout, QuantizedAttention, Recurrent, SlidingWindow

LayoutFn = Callable[[object, dict], tuple]

FAMILIES: dict[str, LayoutFn] = {
    **{t: dense.layout for t in dense.MODEL_TYPES},
    **{t: gemma.layout for t in gemma.MODEL_TYPES},
    **{t: qwen_hybrid.layout for t in qwen_hybrid.MODEL_TYPES},
}


class UnsupportedModel(ValueError):
    """The model's cache layout is not one we can cut into blocks; it is served without caching."""

    def __init__(self, model_type: str, reason: str):
        super().__init__(f"KV block caching does not support model_type {model_type!r} ({reason})")
        self.model_type = model_type


def layout_for(model, config: dict, kv_codec: str = "native", group_size: int = 64) -> Layout:
    """The model's layout under `kv_codec`, checked against the caches mlx-lm actually makes."""
    from cluster.models.resolve import text_config

    model_type = config.get("model_type", "?")
    fn = FAMILIES.get(model_type)
    if fn is None:
        raise UnsupportedModel(model_type, f"no layout declared for this family; supported: {', '.join(sorted(FAMILIES))}")
    specs = tuple(fn(model, text_config(config)))
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:  # a pipeline stage (engine/sharding.py) caches its own layers only
        specs = specs[inner.start_idx:inner.end_idx]
    _check_against_mlx(model_type, specs, model)
    if kv_codec in ("q8", "q4"):  # tq*: the model runs native caches, blocks are packed (kvcache/payload_codec.py)
        if any(not isinstance(s, FullAttention) for s in specs):
            raise UnsupportedModel(model_type, f"with kv_codec {kv_codec}: it needs a model with full attention only, "
                                               "as mlx-lm cannot quantize sliding-window or recurrent caches; "
                                               "kv_codec native or tq8/tq4/tq3/tq2 cache this model")
        bits = {"q8": 8, "q4": 4}[kv_codec]
        specs = tuple(QuantizedAttention(bits, group_size) for _ in specs)
    return Layout(family=model_type, layers=specs)


def _check_against_mlx(model_type: str, specs: tuple, model) -> None:
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    if len(caches) != len(specs):
        raise UnsupportedModel(model_type, f"layout declares {len(specs)} cache entries, mlx-lm makes {len(caches)}")
    for i, (spec, cache) in enumerate(zip(specs, caches)):
        ok = (
            (isinstance(spec, FullAttention) and type(cache) is KVCache)
            or (isinstance(spec, SlidingWindow) and type(cache) is RotatingKVCache
                and cache.max_size == spec.window and cache.keep == 0)
            or (isinstance(spec, Recurrent) and type(cache) is ArraysCache and len(cache.cache) == spec.arrays)
        )
        if not ok:
            raise UnsupportedModel(model_type, f"cache entry {i} is {type(cache).__name__}, layout says {spec}")
