"""A replica's measured speeds, kept on the node's disk so that a restart starts from them.

Restore or recompute is chosen from the replica's own measured speeds (costs.py).
A replica that knows none takes every hit, since taking one is how it learns. On
a machine where the disk does not pay (the H200: a 1.7 GB/s disk and as slow a
move to the device, against 25k prefill tokens/s), a restarted replica's first
disk hit then costs several times a cold prefill. So the speeds are saved per
fingerprint (the model, its dtype and codec, and the backend: a CUDA node's speeds
never seed a Metal replica's) and seed the next replica of the same fingerprint
on the node, which goes on measuring from them.

The file is a hint, not a contract: a missing, unreadable, malformed or foreign
file is logged and ignored, and the replica measures from nothing.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)


class Speeds(BaseModel):
    """What one replica measured; 0 is "not measured"."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(description="The fingerprint's namespace, hex: whose speeds these are.")
    prefill_tps: float = Field(0.0, ge=0, description="Prefill tokens/s (the scheduler's moving average).")
    ram_bps: float = Field(0.0, ge=0, description="Bytes/s of restores from device blocks alone.")
    disk_bps: float = Field(0.0, ge=0, description="Bytes/s of disk reads, checks included.")
    move_bps: float = Field(0.0, ge=0, description="Bytes/s of moving blocks read in to the device.")
    write_bps: float = Field(0.0, ge=0, description="Bytes/s of spills written, fsync included (stands in for "
                             "the disk's read speed until a read is measured).")
    saved: float = Field(0.0, description="When it was written (Unix seconds).")

    def measured(self) -> bool:
        return any((self.prefill_tps, self.ram_bps, self.disk_bps, self.move_bps, self.write_bps))

    def same(self, other: "Speeds | None") -> bool:
        """The same speeds, whenever each was saved."""
        return other is not None and self.model_dump(exclude={"saved"}) == other.model_dump(exclude={"saved"})


def speeds_path(node_dir: Path, namespace: bytes) -> Path:
    return Path(node_dir) / "speeds" / f"{namespace.hex()}.json"


def load_speeds(path: Path, namespace: bytes) -> Speeds | None:
    """The speeds saved at `path` for `namespace`, or None (never an exception)."""
    try:
        speeds = Speeds.model_validate_json(Path(path).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, ValueError) as e:
        log.warning("ignoring saved speeds %s (%s); measuring from nothing", path, str(e).splitlines()[0])
        return None
    if speeds.namespace != namespace.hex():
        log.warning("ignoring saved speeds %s: they are another fingerprint's (%s)", path, speeds.namespace[:16])
        return None
    return speeds


def save_speeds(path: Path, speeds: Speeds) -> None:
    """Write atomically (a temporary file renamed over the old one), so a crash leaves the old or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(speeds.model_copy(update={"saved": time.time()}).model_dump()).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".speeds-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
