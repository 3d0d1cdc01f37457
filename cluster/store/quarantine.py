"""The quarantine: block files refused for bad content, kept as evidence, within a byte bound.

Layout under the node's data dir:

    quarantine/<reason>/<namespace hex:16>-<key hex>.blk   a refused block file
    quarantine/log.jsonl                                   why, one JSON line each
    quarantine/log.jsonl.1                                 the previous log, after rotation

Only bad content comes here (see block_files): a transient read error is a miss.
The quarantine's bytes count against the disk tier's budget, and the quarantine
itself is bounded: past `limit` bytes the oldest files are deleted first (by
mtime, then name), so a disk that keeps corrupting blocks cannot fill the
drive. The log rotates once it passes LOG_BYTES.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

log = logging.getLogger(__name__)

LOG_BYTES = 1 << 20


class Quarantine:
    def __init__(self, root: Path, limit: int):
        self.root = Path(root)
        self.limit = limit
        self._files: dict[Path, tuple[float, int]] = {}  # path -> (mtime, size)
        self.bytes = 0
        self.deleted = 0
        self._lock = threading.Lock()
        self._scan()

    def _scan(self) -> None:
        if not self.root.is_dir():
            return
        for f in self.root.glob("*/*.blk"):
            try:
                st = f.stat()
            except OSError:
                continue
            self._files[f] = (st.st_mtime, st.st_size)
            self.bytes += st.st_size
        self._trim()

    def __len__(self) -> int:
        return len(self._files)

    def add(self, src: Path, ns: bytes, key: bytes, reason: str, detail: str, now: float) -> bool:
        """Move `src` under quarantine/<reason>/ and log why; False if it was gone already (quarantined
        by a concurrent reader of the same bad block, or evicted)."""
        dst_dir = self.root / reason
        dst_dir.mkdir(parents=True, exist_ok=True)
        dst = dst_dir / f"{ns.hex()[:16]}-{src.name}"
        with self._lock:
            try:
                shutil.move(str(src), dst)
                os.utime(dst, (now, now))
                size = dst.stat().st_size
                old = self._files.pop(dst, None)
                if old is not None:
                    self.bytes -= old[1]
                self._files[dst] = (now, size)
                self.bytes += size
            except FileNotFoundError:
                return False
            self._log({"time": now, "key": key.hex(), "namespace": ns.hex(), "reason": reason,
                       "detail": detail, "file": str(dst)})
            self._trim()
            return True

    def _trim(self) -> None:
        """Delete the oldest files until the quarantine fits its limit."""
        if self.bytes <= self.limit:
            return
        for path, (_, size) in sorted(self._files.items(), key=lambda kv: (kv[1][0], str(kv[0]))):
            if self.bytes <= self.limit:
                break
            path.unlink(missing_ok=True)
            del self._files[path]
            self.bytes -= size
            self.deleted += 1

    def _log(self, record: dict) -> None:
        path = self.root / "log.jsonl"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists() and path.stat().st_size > LOG_BYTES:
                os.replace(path, self.root / "log.jsonl.1")
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # the log is evidence, not a reason to fail a read
            log.warning("could not write the quarantine log: %s", e)

    def stats(self) -> dict:
        return {"files": len(self._files), "bytes": self.bytes, "limit": self.limit, "deleted": self.deleted}
