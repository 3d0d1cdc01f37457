"""Wire a PrefixCache to a loaded model: layout, measured sizes, fingerprint, RAM tier."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from cluster.config import CacheConfig
from cluster.families.codecs import new_cache
from cluster.families.registry import UnsupportedModel, layout_for
from cluster.families.specs import Layout, Recurrent
from cluster.kvcache.prefix_cache import PrefixCache, layout_byte_sizes
from cluster.models.resolve import read_config
from cluster.store.fingerprint import Fingerprint, compute_fingerprint
from cluster.kvcache.disk_client import DiskClient, StoreLink
from cluster.kvcache.tiers import TieredBlocks

log = logging.getLogger(__name__)


@dataclass
class CacheSetup:
    """The outcome for one model: a cache, or why it runs without one."""

    cache: Optional[PrefixCache]
    fingerprint: Optional[Fingerprint]
    disabled_reason: Optional[str] = None


def probe(model, layout: Layout) -> tuple[mx.Dtype, int, int]:
    """Run 4 tokens through fresh caches: KV dtype, checkpoint bytes, KV bytes per token."""
    caches = [new_cache(spec) for spec in layout.layers]
    model(mx.array([[1, 2, 3, 4]]), cache=caches)
    mx.eval([c.state for c in caches])
    kv = next(c for spec, c in zip(layout.layers, caches) if not isinstance(spec, Recurrent))
    dtype = kv.keys[1].dtype if isinstance(kv.keys, tuple) else kv.keys.dtype
    state_bytes, per_token = layout_byte_sizes(layout, caches)
    return dtype, state_bytes, per_token


def setup_cache(model, tokenizer, model_dir: Path, config: CacheConfig, cache_dir: Path,
                store_link: Optional[StoreLink] = None, listener=None) -> CacheSetup:
    """`store_link` is the node's disk tier (None: RAM only); `listener` receives tier events."""
    if not config.enabled:
        return CacheSetup(None, None, "disabled by configuration")
    try:
        layout = layout_for(model, read_config(model_dir), config.kv_codec, config.kv_group_size)
    except UnsupportedModel as e:
        log.warning("%s; serving without KV block reuse", e)
        return CacheSetup(None, None, str(e))
    dtype, state_bytes, per_token = probe(model, layout)
    bits = {"q8": 8, "q4": 4}.get(config.kv_codec)
    fp = compute_fingerprint(model_dir, dtype=str(dtype).removeprefix("mlx.core."), kv_codec=config.kv_codec,
                             kv_bits=bits, kv_group=config.kv_group_size if bits else None,
                             block_tokens=config.block_tokens,
                             chat_template=getattr(tokenizer, "chat_template", None), cache_dir=cache_dir)
    disk = DiskClient(store_link, fp.namespace, config.spill_queue_bytes) if store_link is not None else None
    tier = TieredBlocks(config.ram_bytes, fp.namespace, disk, listener)
    cache = PrefixCache(layout, fp.namespace, config, tier, dtype, state_bytes, per_token)
    log.info("KV block cache for %s: namespace %s, layout %s, %d B/token, checkpoint every %d blocks",
             layout.family, fp.short, layout.describe(), per_token, cache.every)
    return CacheSetup(cache, fp)
