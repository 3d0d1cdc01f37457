"""Metal memory settings for a replica, from what the GPU reports (a no-op off Metal).

As mlx-lm does before generating, the wired limit is raised to the GPU's
recommended working set, so model weights and KV stay resident instead of being
paged out between requests. The memory limit (a guideline MLX follows during
evaluation; its default is 1.5x the working set) is lowered to the working set
itself: on a Mac the GPU shares RAM with everything else, and a replica that
grows past it pushes the whole machine into swap, or worse.

Call it on the model thread, before any work. Only verifiable on a Mac: the
CPU backend has no wired memory and ignores both limits.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def configure_memory() -> dict:
    """Apply the limits; return what was set (for status and logs)."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return {"metal": False}
    info = mx.device_info()
    working_set = info.get("max_recommended_working_set_size")
    if not working_set:
        return {"metal": True, "working_set": None}
    try:
        mx.set_wired_limit(working_set)
    except Exception as e:  # macOS < 15 or a lowered system wired limit (sysctl iogpu.wired_limit_mb)
        log.warning("could not set the Metal wired limit to %d bytes: %s", working_set, e)
    mx.set_memory_limit(working_set)
    log.info("Metal: wired and memory limits set to %.1f GiB (device memory %.1f GiB)",
             working_set / 2**30, info.get("memory_size", 0) / 2**30)
    return {"metal": True, "working_set": working_set, "memory_size": info.get("memory_size")}


def budget_warning(memory: dict, weights_bytes: int, ram_tier_bytes: int) -> str | None:
    """Why the RAM tier may not fit next to the weights in the GPU's working set (None: it fits, or no Metal).

    The RAM tier holds device blocks (kvcache/device_blocks.py): on a Mac that is wired unified memory,
    counted with the weights and the live caches."""
    working_set = memory.get("working_set")
    if not working_set or weights_bytes + ram_tier_bytes <= working_set:
        return None
    return (f"weights ({weights_bytes / 2**30:.1f} GiB) and the RAM tier ({ram_tier_bytes / 2**30:.1f} GiB, "
            f"--cache-ram-gb) exceed the GPU's working set ({working_set / 2**30:.1f} GiB) before any live cache: "
            f"lower --cache-ram-gb to at most {max(0, working_set - weights_bytes) / 2**30 * 0.75:.1f}")
