"""One model split over several nodes: the distributed group and the sharded model, on each rank's model thread.

A sharded replica (`shards: N`) runs one rank per node. Every rank:
1. starts MLX's distributed group from a hostfile that lists every rank's `ip:port` (ring: TCP over any
   network; on Macs with Thunderbolt 5 and RDMA enabled, JACCL), its rank in `MLX_RANK`;
2. loads the whole model lazily and keeps its own part, in one of mlx-lm's two ways:
   - tensor parallel (`model.shard(group)`): each rank holds 1/N of every layer's heads and MLP columns,
     and every layer sums over the ranks (two all_sums per layer: fast links);
   - pipeline parallel (`model.model.pipeline(group)`): each rank holds a run of whole layers (rank 0 the
     last), receives the hidden state from the rank before, sends it on, and the last stage's output is
     gathered to every rank (one send per forward: slow links do; the ranks take turns, so one request
     does not run faster); every layer is computed whole, so the logits are the whole model's, bitwise;
3. runs the same scheduler turns as every other rank (lockstep.py), led by the replica's rank, which is
   not always rank 0: a rank is its node's (`ranks_by_node`).

Tensor parallel needs the family's `shard` in mlx-lm (qwen3, llama, qwen3_5, qwen3_moe ...), pipeline its
`pipeline` (qwen3_5, qwen3_next, qwen3_moe, qwen2, the DeepSeek ones ...) and send/recv. The group is
always ring, whose collectives and send/recv run on the CPU's communication stream, so both modes run on
Metal, CUDA and the CPU (NCCL, MLX's CUDA-only backend, lacks send/recv; it is not used). qwen3_next has
only pipeline. `auto` takes tensor where the family has it, else pipeline. A model that cannot be split is
refused by name before any rank starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

SHARD_MODES = ("tensor", "pipeline")


class UnshardableModel(ValueError):
    """The model's family cannot be split the way the config asks."""


def _modes_of(module) -> set[str]:
    """The ways mlx-lm can split a model module's Model: tensor (its `shard`), pipeline (a `pipeline` class)."""
    modes = set()
    if callable(getattr(getattr(module, "Model", None), "shard", None)):
        modes.add("tensor")
    if any(isinstance(c, type) and callable(getattr(c, "pipeline", None)) for c in vars(module).values()):
        modes.add("pipeline")
    return modes


def families() -> dict[str, list[str]]:
    """mlx-lm model types by the way they can be split: {"tensor": [...], "pipeline": [...]}."""
    import importlib
    import pkgutil

    import mlx_lm.models

    out: dict[str, list[str]] = {m: [] for m in SHARD_MODES}
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        if info.name in ("pipeline", "base", "cache"):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # olmo prints how to install its dependency, then exits
                module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):
            continue
        for mode in _modes_of(module):
            out[mode].append(info.name)
    return {m: sorted(names) for m, names in out.items()}


def tensor_parallel_families() -> list[str]:
    """mlx-lm model types whose Model has `shard` (tensor parallel)."""
    return families()["tensor"]


def check_shardable(model_type: str, mode: str, shards: int, config: dict) -> str:
    """The mode `model_type` splits `shards` ways in (`auto`: tensor where it can, else pipeline); raise
    UnshardableModel, naming what can, if it cannot."""
    import importlib

    if mode not in (*SHARD_MODES, "auto"):
        raise UnshardableModel(f"shard_mode: {mode!r} is not a mode; use tensor, pipeline or auto")
    try:
        modes = _modes_of(importlib.import_module(f"mlx_lm.models.{model_type}"))
    except ImportError:
        modes = set()
    chosen = ("tensor" if "tensor" in modes else "pipeline" if "pipeline" in modes else None) if mode == "auto" \
        else mode if mode in modes else None
    if chosen is None:
        known = families()
        wanted = {"auto": "either mode", "tensor": "tensor parallel (its shard())",
                  "pipeline": "pipeline parallel (its pipeline())"}[mode]
        raise UnshardableModel(
            f"shards: {shards}: mlx-lm cannot split {model_type!r} models in {wanted}; tensor parallel can split "
            f"{', '.join(known['tensor'])}; pipeline parallel can split {', '.join(known['pipeline'])}")
    text = config.get("text_config", {})
    if chosen == "tensor":
        for key in ("num_key_value_heads", "num_attention_heads"):
            heads = config.get(key) or text.get(key)
            if heads and heads % shards:
                raise UnshardableModel(f"shards: {shards} does not divide the model's {key} ({heads}); "
                                       f"choose shards among {[d for d in range(2, heads + 1) if heads % d == 0]}")
    else:
        layers = config.get("num_hidden_layers") or text.get("num_hidden_layers")
        if layers and shards > layers:
            raise UnshardableModel(f"shards: {shards} is more than the model's {layers} layers; pipeline parallel "
                                   "gives every rank one layer at least")
    return chosen


def ranks_by_node(node_ids: list[str]) -> list[int]:
    """Each participant's rank, by the order of its node's persistent id (the replica's first, then its
    followers'): a node keeps its rank whenever a replica over the same nodes starts again, whichever of them
    Serve puts the replica on, so the blocks on its disk, which name their rank, are its own again."""
    order = sorted(range(len(node_ids)), key=lambda i: node_ids[i])
    return [order.index(i) for i in range(len(node_ids))]


def hostfile(addresses: list[str], directory: Path) -> Path:
    """MLX's ring hostfile: one list of `ip:port` per rank, in rank order."""
    fd, path = tempfile.mkstemp(prefix="mlx-hosts-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump([[a] for a in addresses], f)
    return Path(path)


def join_group(rank: int, addresses: list[str], directory: Path, devices: list[list] | None = None):
    """Join the replica's group (model thread; returns once every rank has connected): ring over `addresses`
    (every rank's `ip:port`, in rank order), or, given JACCL's device matrix (`shard_backend: jaccl`), JACCL,
    with rank 0's address as its coordinator (jaccl.py)."""
    if devices is None:
        return init_group(rank, hostfile(addresses, directory))
    from cluster.engine import jaccl

    return _checked(jaccl.init_group(rank, devices, addresses[0], directory), rank)


def init_group(rank: int, hosts: Path):
    """Join a ring group from its hostfile (model thread; returns once every rank has connected)."""
    import mlx.core as mx

    os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), str(hosts)
    return _checked(mx.distributed.init(backend="ring", strict=True), rank)


def _checked(group, rank: int):
    if group.rank() != rank:
        raise RuntimeError(f"MLX's distributed group gave rank {group.rank()}, expected {rank}")
    return group


def shard(model, group, mode: str = "tensor") -> None:
    """Keep this rank's part of `model` and drop the rest (model thread); `mode` as check_shardable chose."""
    import mlx.core as mx

    if mode == "tensor":
        model.shard(group)
    elif mode == "pipeline":
        model.model.pipeline(group)  # as mlx-lm's sharded_load: the layers of other stages become None
    else:
        raise UnshardableModel(f"shard_mode: {mode!r} is not a mode; use tensor or pipeline")
    mx.eval(model.parameters())


def geometry(mode: str, size: int, rank: int) -> dict:
    """A rank's place in a sharded model, as its prefix cache's fingerprint names it: a rank's blocks hold its
    own heads only, so they never restore into another rank, another split or the whole model."""
    return {"mode": mode, "size": size, "rank": rank}
