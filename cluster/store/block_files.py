"""Block files: how a block is named on disk, read back, verified, and made durable.

Shared by the disk tier (writes, recovery) and by replicas, which read pinned
block files directly rather than through the store process.

A failed read is one of two things, and they are handled differently:
- bad content (any BlockError: truncated, flipped bits, foreign, misfiled):
  the file is evidence and goes to quarantine;
- a transient or environmental error (ENOENT because the block was evicted or
  its pin expired, EMFILE, EAGAIN, EIO, ...): the file may be fine, so it is a
  miss and a log line, never a quarantine.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from cluster.store import block_format
from cluster.store.block_format import BlockError, Header
from cluster.store.hashing import state_key

# How much of a file to read to parse a typical header in one go.
HEADER_PREFIX = 4096


def key_of(header: Header) -> bytes:
    """The storage key of a block: its id, or for a checkpoint the state key of its block."""
    return header.id if header.kind == "kv" else state_key(header.id)


@dataclass(frozen=True)
class ReadFailure:
    """Why a located block could not be used."""

    key: bytes
    reason: str  # a BlockError reason, or the errno name of a transient error
    detail: str
    bad_content: bool  # True: quarantine the file; False: a miss, the file is left alone
    file_id: Optional[tuple[int, int]] = None  # (st_dev, st_ino) of the file whose bytes were bad

    @property
    def gone(self) -> bool:
        """The file no longer exists (evicted, or removed behind the store's back)."""
        return self.reason == "ENOENT"


def read_file(path: Path | str, size: Optional[int] = None,
              alloc: Optional[Callable[[int], np.ndarray]] = None) -> tuple[np.ndarray, tuple[int, int]]:
    """A whole file in a fresh uint8 array (one copy from the page cache; `alloc(n)` makes it, np.empty by
    default), and the file's identity (device, inode): which file was read, should its bytes be refused."""
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        n = size if size is not None else st.st_size
        buf = alloc(n) if alloc is not None else np.empty(n, dtype=np.uint8)
        got = f.readinto(memoryview(buf))
        return (buf[:got] if got != n else buf), (st.st_dev, st.st_ino)


def read_verified(loc: Optional[tuple[str, int]], ns: bytes, key: bytes,
                  alloc: Optional[Callable[[int], np.ndarray]] = None
                  ) -> tuple[Optional[np.ndarray], Optional[ReadFailure]]:
    """Read a located block file (into `alloc`'s memory, see read_file) and verify its framing, checksums
    and identity.

    Returns (data, None); (None, failure) for a bad or unreadable block; or
    (None, None) for a miss (`loc` is None)."""
    if loc is None:
        return None, None
    file_id = None
    try:
        data, file_id = read_file(loc[0], loc[1], alloc)
        block_format.verify(data, ns, key, key_of)
        return data, None
    except BlockError as e:
        return None, ReadFailure(key, e.reason, str(e), bad_content=True, file_id=file_id)
    except OSError as e:
        name = errno.errorcode.get(e.errno or 0, "EIO")
        return None, ReadFailure(key, name, str(e), bad_content=False)


def read_header(path: Path) -> Header:
    """Parse and checksum a block file's header without reading its payload."""
    with open(path, "rb") as fh:
        prefix = fh.read(HEADER_PREFIX)
        need = block_format.header_size(prefix)
        if need > len(prefix):
            prefix += fh.read(need - len(prefix))
    return block_format.peek(prefix)


def durable_sync(fd: int) -> None:
    """Make a file's (or directory's) contents survive power loss.

    On macOS, fsync() only hands the data to the drive, which may keep it in its
    volatile cache; F_FULLFSYNC asks the drive to flush it. It is much slower,
    so it runs once per file plus once per directory of a spill batch.
    Only verifiable on a Mac: on Linux fsync is the flush."""
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:  # some filesystems (network, FAT) do not support it
            pass
    os.fsync(fd)


def sync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        durable_sync(fd)
    finally:
        os.close(fd)
