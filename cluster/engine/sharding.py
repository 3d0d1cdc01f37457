"""One model split over several nodes: the distributed group and the sharded model, on each rank's model thread.

A sharded replica (`shards: N`) runs one rank per node. Every rank:
1. starts MLX's distributed group from a hostfile that lists every rank's `ip:port` (ring: TCP over any
   network; on Macs with Thunderbolt 5 and RDMA enabled, JACCL), its rank in `MLX_RANK`;
2. loads the whole model lazily and keeps its own part: tensor parallel (`model.shard(group)`, mlx-lm's:
   each rank holds 1/N of every layer's heads and MLP columns, and every layer sums over the ranks);
3. runs the same scheduler turns as every other rank (lockstep.py).

Tensor parallel needs the family's `shard` in mlx-lm (qwen3, llama, qwen3_5, qwen3_next ...); pipeline
parallel needs send/recv, which MLX's CUDA backend lacks, and is not offered yet. A model that cannot be
split is refused by name before any rank starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

SHARD_MODES = ("tensor",)


class UnshardableModel(ValueError):
    """The model's family cannot be split the way the config asks."""


def tensor_parallel_families() -> list[str]:
    """mlx-lm model types whose Model has `shard` (tensor parallel)."""
    import importlib
    import pkgutil

    import mlx_lm.models

    names = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # olmo prints how to install its dependency, then exits
                module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):
            continue
        if callable(getattr(getattr(module, "Model", None), "shard", None)):
            names.append(info.name)
    return sorted(names)


def check_shardable(model_type: str, mode: str, shards: int, config: dict) -> None:
    """Raise UnshardableModel, naming what can, unless `model_type` splits `shards` ways in `mode`."""
    import importlib

    if mode not in SHARD_MODES:
        raise UnshardableModel(f"shard_mode: {mode!r} is not offered yet; use shard_mode: tensor")
    try:
        model_class = importlib.import_module(f"mlx_lm.models.{model_type}").Model
    except (ImportError, AttributeError):
        model_class = None
    if not callable(getattr(model_class, "shard", None)):
        raise UnshardableModel(
            f"shards: {shards}: mlx-lm cannot split {model_type!r} models (tensor parallel needs its shard()); "
            f"these families can: {', '.join(tensor_parallel_families())}")
    for key in ("num_key_value_heads", "num_attention_heads"):
        heads = config.get(key) or config.get("text_config", {}).get(key)
        if heads and heads % shards:
            raise UnshardableModel(f"shards: {shards} does not divide the model's {key} ({heads}); "
                                   f"choose shards among {[d for d in range(2, heads + 1) if heads % d == 0]}")


def hostfile(addresses: list[str], directory: Path) -> Path:
    """MLX's ring hostfile: one list of `ip:port` per rank, in rank order."""
    fd, path = tempfile.mkstemp(prefix="mlx-hosts-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump([[a] for a in addresses], f)
    return Path(path)


def init_group(rank: int, hosts: Path):
    """Join the group (model thread; returns once every rank has connected)."""
    import mlx.core as mx

    os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), str(hosts)
    group = mx.distributed.init(backend="ring", strict=True)
    if group.rank() != rank:
        raise RuntimeError(f"MLX's distributed group gave rank {group.rank()}, expected {rank}")
    return group


def shard(model, group, mode: str = "tensor") -> None:
    """Keep this rank's part of `model` and drop the rest (model thread)."""
    import mlx.core as mx

    if mode != "tensor":
        raise UnshardableModel(f"shard_mode: {mode!r} is not offered yet; use shard_mode: tensor")
    model.shard(group)
    mx.eval(model.parameters())


def geometry(mode: str, size: int, rank: int) -> dict:
    """A rank's place in a sharded model, as its prefix cache's fingerprint names it: a rank's blocks hold its
    own heads only, so they never restore into another rank, another split or the whole model."""
    return {"mode": mode, "size": size, "rank": rank}
