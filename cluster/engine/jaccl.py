"""JACCL: MLX's RDMA backend over Thunderbolt 5, for a sharded replica's group on Macs that have it.

Ring, the default, runs over TCP on any network. JACCL runs its collectives over RDMA on Thunderbolt 5
cables (macOS 26.2+, RDMA enabled once per Mac in Recovery with `rdma_ctl enable`): microseconds a
message instead of tens, which is what tensor parallel's two sums a layer need.

What MLX's JACCL takes (mlx 0.32, `mx.distributed.init(backend="jaccl")`):
- `MLX_RANK`;
- `MLX_IBV_DEVICES`: the path of a JSON matrix, one row per rank, entry [i][j] the RDMA device on rank i's
  Mac whose cable reaches rank j (`null` on the diagonal; a list where several cables do). Every pair cabled
  is a mesh (at most 8 Macs); only neighbours in rank order is a ring, which JACCL also takes;
- `MLX_JACCL_COORDINATOR`: `ip:port` on rank 0's Mac, where rank 0 listens while the ranks exchange their
  RDMA queue pairs (plain TCP, setup only).

Which device reaches which Mac is found as `mlx.distributed_config --over thunderbolt --auto-setup` leaves the
Macs: each cable's two interfaces (`enX`, whose RDMA device is `rdma_enX`) get IPv4 addresses in a subnet of
their own. So every rank reports its RDMA devices (`ibv_devices`) with their interfaces' IPv4 subnets
(`local_links`), and two ranks are cabled where they share a subnet (`device_matrix`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

RDMA_PREFIX = "rdma_"
MESH_MAX = 8  # JACCL's mesh takes up to 8 ranks (MESH_MAX_PEERS in mlx's jaccl/mesh_impl.h)
SETUP_HINT = ("set up RDMA over Thunderbolt 5 (on every Mac: macOS 26.2 or later; RDMA enabled once in Recovery "
              "with `rdma_ctl enable`, after which `ibv_devices` lists rdma_en* devices; the Thunderbolt links "
              "addressed with `mlx.distributed_config --over thunderbolt --backend jaccl --auto-setup`)")


class JacclUnavailable(ValueError):
    """shard_backend: jaccl where this MLX or these Macs cannot run it."""


def check_available() -> None:
    """Raise JacclUnavailable unless this MLX build has JACCL (macOS 26.2+ on Apple silicon)."""
    import mlx.core as mx

    if not mx.distributed.is_available(backend="jaccl"):
        raise JacclUnavailable("shard_backend: jaccl: this MLX has no JACCL; use shard_backend: ring "
                               f"(`--shard-backend ring`; TCP, any network), or {SETUP_HINT}")


def parse_ibv_devices(text: str) -> list[str]:
    """The RDMA device names `ibv_devices` lists (`rdma_en2` ...)."""
    return sorted({w for w in re.findall(r"\S+", text) if w.startswith(RDMA_PREFIX)})


def links_of(devices: list[str], addresses: dict[str, list[tuple[str, str]]]) -> list[dict]:
    """Each RDMA device whose interface has an IPv4 address: {"device", "network"}. `addresses`: interface ->
    [(ipv4, netmask)] (psutil's view)."""
    out = []
    for device in devices:
        for ip, netmask in addresses.get(device[len(RDMA_PREFIX):], []):
            out.append({"device": device, "network": str(ipaddress.ip_interface(f"{ip}/{netmask}").network)})
    return out


def local_links() -> list[dict]:
    """This Mac's RDMA devices with their interfaces' IPv4 subnets; [] where there are none."""
    import socket

    import psutil

    try:
        text = subprocess.run(["ibv_devices"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    addresses = {name: [(a.address, a.netmask) for a in addrs if a.family == socket.AF_INET and a.netmask]
                 for name, addrs in psutil.net_if_addrs().items()}
    return links_of(parse_ibv_devices(text), addresses)


def device_matrix(links: list[list[dict]], nodes: list[str]) -> list[list]:
    """MLX's device matrix for ranks whose links (`local_links`, in rank order) and nodes are given: [i][j] the
    device of rank i that shares a subnet with one of rank j's (a list where several do), None where none.
    Raise JacclUnavailable, naming what is missing, unless the ranks form a mesh or a ring in rank order."""
    n = len(links)
    for rank, own in enumerate(links):
        if not own:
            raise JacclUnavailable(f"shard_backend: jaccl: node {nodes[rank]} has no RDMA device with an IPv4 "
                                   f"address; {SETUP_HINT}")
    matrix: list[list] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                theirs = {link["network"] for link in links[j]}
                found = sorted({link["device"] for link in links[i] if link["network"] in theirs})
                matrix[i][j] = found[0] if len(found) == 1 else found or None
    mesh = all(matrix[i][j] is not None for i in range(n) for j in range(n) if i != j)
    ring = all(matrix[i][(i + 1) % n] is not None and matrix[i][(i - 1) % n] is not None for i in range(n))
    if mesh and n > MESH_MAX and not ring:
        raise JacclUnavailable(f"shard_backend: jaccl: a mesh of {n} Macs is more than JACCL's {MESH_MAX}; "
                               "use fewer shards, or shard_backend: ring")
    if not (mesh or ring):
        missing = [(nodes[i], nodes[j]) for i in range(n) for j in range(i + 1, n) if matrix[i][j] is None]
        raise JacclUnavailable(
            "shard_backend: jaccl needs a Thunderbolt cable between every two Macs of a replica (or between each "
            "and its neighbours in rank order, as a ring); none found between "
            + ", ".join(f"{a} and {b}" for a, b in missing) + f"; {SETUP_HINT}")
    return matrix


def init_group(rank: int, matrix: list[list], coordinator: str, directory: Path):
    """Join a JACCL group (model thread): the device matrix written where MLX reads it, rank 0 listening on
    `coordinator` (its node's `ip:port`) while the ranks set up. Every rank checked JACCL was there when it
    reported its links (shard_rank.py `rdma_links`)."""
    import mlx.core as mx

    fd, path = tempfile.mkstemp(prefix="mlx-ibv-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(matrix, f)
    os.environ.update({"MLX_RANK": str(rank), "MLX_IBV_DEVICES": path, "MLX_JACCL_COORDINATOR": coordinator})
    return mx.distributed.init(backend="jaccl", strict=True)
