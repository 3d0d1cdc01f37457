"""Wire a PrefixCache to a loaded model: layout, measured shapes, fingerprint, tiers.

`setup_cache` runs a 4-token forward pass, so it belongs on the model thread
like every other MLX call of a replica.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from cluster.config import CacheConfig
from cluster.engine import invariant
from cluster.engine.schedule import Schedule
from cluster.families.codecs import AFFINE, capture_block, codec_descriptor, new_cache, payload_signature
from cluster.families.registry import UnsupportedModel, layout_for
from cluster.families.specs import Layout, Recurrent
from cluster.kernels import cuda_upload
from cluster.kvcache.breaker import Breaker
from cluster.kvcache.disk_client import DiskClient
from cluster.kvcache.payload_codec import payload_codec
from cluster.kvcache.prefix_cache import PrefixCache, Shapes, host_entries, layout_byte_sizes
from cluster.kvcache.store_link import StoreLink
from cluster.kvcache.tiers import Tiers
from cluster.models.resolve import read_config
from cluster.store.arrays import dtype_tag
from cluster.store.fingerprint import Fingerprint, compute_fingerprint

log = logging.getLogger(__name__)


@dataclass
class CacheSetup:
    """The outcome for one model: a cache, or why it runs without one."""

    cache: Optional[PrefixCache]
    fingerprint: Optional[Fingerprint]
    disabled_reason: Optional[str] = None


def probe(model, layout: Layout, block_tokens: int) -> Shapes:
    """Run 4 tokens through fresh caches and read off what blocks of this model hold."""
    caches = [new_cache(spec) for spec in layout.layers]
    model(mx.array([[1, 2, 3, 4]]), cache=caches)
    mx.eval([c.state for c in caches])
    kv = next((c for spec, c in zip(layout.layers, caches) if not isinstance(spec, Recurrent)), None)
    if kv is not None:
        dtype = kv.keys[1].dtype if isinstance(kv.keys, tuple) else kv.keys.dtype
    else:  # recurrent layers only (a pipeline stage of a hybrid, engine/sharding.py): the state's dtype
        from mlx.utils import tree_flatten

        dtype = tree_flatten([c.state for c in caches])[0][1].dtype
    signatures = [payload_signature(spec, c, block_tokens) for spec, c in zip(layout.layers, caches)]
    state_bytes, per_token = layout_byte_sizes(layout, caches)
    return Shapes(dtype=dtype_tag(dtype), kv=tuple(s[0] for s in signatures), state=tuple(s[1] for s in signatures),
                  state_bytes=state_bytes, kv_bytes_per_token=per_token)


class UnsupportedCodec(ValueError):
    """This backend's MLX cannot run the chosen --kv-codec on this model."""


def probe_codec(model, layout: Layout, config: CacheConfig) -> Shapes:
    """`probe`, plus (q8/q4, where the model attends over mlx's quantized cache) one decode step, so that a
    backend lacking a quantized kernel for this model's shapes (MLX's CUDA backend has gaps) fails here, at
    start, with what to use instead, never mid-request."""
    if config.kv_codec not in AFFINE:
        return probe(model, layout, config.block_tokens)
    try:
        shapes = probe(model, layout, config.block_tokens)
        caches = [new_cache(spec) for spec in layout.layers]
        model(mx.array([[1, 2, 3, 4]]), cache=caches)
        with invariant.one_query():  # the decode step as a request's runs
            mx.eval(model(mx.array([[5]]), cache=caches))
        return shapes
    except (RuntimeError, ValueError) as e:
        from cluster.store.fingerprint import backend

        raise UnsupportedCodec(f"--kv-codec {config.kv_codec} needs MLX's quantized attention kernels, which the "
                               f"{backend()} backend lacks for this model ({e}); use --kv-codec native (exact) "
                               f"or tq8/tq4 (packed in the tiers, attention in the model's own dtype)") from e


def probe_block(model, layout: Layout, block_tokens: int) -> list:
    """Block 0 of a fixed prompt, as a block would hold it: real K/V to measure a lossy codec on."""
    caches = [new_cache(spec) for spec in layout.layers]
    model(mx.array([[(i * 37 + 5) % 1000 for i in range(block_tokens)]]), cache=caches)
    return host_entries([capture_block(spec, c, 0, block_tokens, block_tokens) for spec, c in zip(layout.layers, caches)])


def kernels_in_effect(layout: Layout) -> list[str]:
    """Our kernels that compute this model's cache in place of mlx-lm's (other sums, other bytes): they name
    its blocks, so blocks made with them never meet blocks made without."""
    from cluster.kernels import gated_delta_cuda

    out = [gated_delta_cuda.VERSION] if layout.has_recurrent and gated_delta_cuda.in_effect() else []
    if invariant.routes_one_query():  # a prompt's last token and generated tokens attend in it
        out.append(invariant.EXACT_DECODE_VERSION)
    return out


def setup_cache(model, tokenizer, model_dir: Path, config: CacheConfig, cache_dir: Path,
                store_link: Optional[StoreLink] = None, listener=None,
                schedule: Optional[Schedule] = None, prefill_step: int = 512,
                shard: Optional[dict] = None) -> CacheSetup:
    """`store_link` is the node's disk tier (None: RAM only); `listener` receives tier events. The prefill
    schedule is `schedule` if given, else config.resume_at's for this model with `prefill_step`-token chunks
    (engine/schedule.py); the cache's `schedule` says which. `shard`: this rank's place in a sharded model
    ({"mode", "size", "rank"}), part of the fingerprint. The probes are forwards: every rank of a sharded
    model runs this at the same point (their collectives must pair up)."""
    if not config.enabled:
        return CacheSetup(None, None, "disabled by configuration")
    try:
        layout = layout_for(model, read_config(model_dir), config.kv_codec, config.kv_group_size)
    except UnsupportedModel as e:
        log.warning("%s; serving without KV block reuse", e)
        return CacheSetup(None, None, str(e))
    shapes = probe_codec(model, layout, config)
    schedule = schedule or Schedule.of(config.resume_at, config.block_tokens, prefill_step, bool(layout.windows()))
    codec = codec_descriptor(config.kv_codec, config.kv_group_size)
    fp = compute_fingerprint(model_dir, dtype=shapes.dtype, codec=codec, block_tokens=config.block_tokens,
                             chat_template=getattr(tokenizer, "chat_template", None), cache_dir=cache_dir,
                             schedule=schedule.fingerprint(), shard=shard, kernels=kernels_in_effect(layout))
    disk = None
    if store_link is not None:
        disk = DiskClient(store_link, fp.namespace, config.spill_queue_bytes, config.store_timeout_s,
                          config.read_timeout_s, Breaker(config.breaker_failures, config.breaker_cooldown_s))
    payload = payload_codec(config.kv_codec, layout, shapes.kv, fp.namespace)
    if disk is not None and payload is None:  # a device tier: what the disk gives goes to the device, then is let go
        disk.buffers = cuda_upload.pinned_buffers(config.pinned_read_bytes)
    tiers = Tiers(config.ram_bytes, fp.namespace, disk, listener, device=payload is None)
    cache = PrefixCache(layout, fp.namespace, config, tiers, shapes, codec, payload, schedule)
    if disk is not None:  # through the cache, whose costs a caller may replace (bench ttft carries them over)
        disk.on_written = lambda nbytes, seconds: cache.costs.observe("write", nbytes, seconds)
    if payload is not None:
        cache.codec_quality = payload.quality(probe_block(model, layout, config.block_tokens))
        log.info("KV codec %s on this model's own K/V: %s", config.kv_codec, cache.codec_quality)
    log.info("KV block cache for %s: namespace %s, layout %s, %d B/token, checkpoint every %d blocks, "
             "resume at %s (%d-token chunks)", layout.family, fp.short, layout.describe(),
             shapes.kv_bytes_per_token, cache.every, schedule.mode, schedule.chunk_tokens)
    return CacheSetup(cache, fp)
