"""Rebuild the disk tier's index at start: the files are the truth.

- temp files (a write that never reached its rename) are deleted;
- every block file's header is read and checked (framing, header checksum,
  namespace = its directory, key = its file name, size = what the header
  promises); a file whose content fails goes to quarantine with the reason,
  one that cannot be read right now (EMFILE, EIO) is skipped and left alone;
- good blocks enter the index with their last access = the file's mtime
  (reads touch it), so LRU order survives restarts.
Payload checksums are not read here (that would read the whole tier); every
read verifies them anyway.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from cluster.store import block_format
from cluster.store.block_files import key_of, read_header
from cluster.store.block_format import BlockError
from cluster.store.disk_index import Entry

log = logging.getLogger(__name__)


def recover(store) -> dict:
    """Fill `store.index` (a DiskStore's) from its files; quarantine what fails. Returns a report."""
    t0 = time.perf_counter()
    report = {"blocks": 0, "bytes": 0, "quarantined": 0, "skipped": 0, "temp_removed": 0, "seconds": 0.0}
    for ns_dir in sorted(p for p in store.root.iterdir() if p.is_dir()):
        for shard in sorted(p for p in ns_dir.iterdir() if p.is_dir()):
            for f in shard.iterdir():
                _recover_file(store, ns_dir.name, f, report)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    log.info("disk tier %s recovered: %d blocks, %d bytes, %d quarantined, %d temp files removed in %.2fs",
             store.root, report["blocks"], report["bytes"], report["quarantined"], report["temp_removed"],
             report["seconds"])
    return report


def _recover_file(store, ns_hex: str, f: Path, report: dict) -> None:
    if f.name.startswith(".") and f.name.endswith(".tmp"):
        f.unlink(missing_ok=True)
        report["temp_removed"] += 1
        return
    if not f.name.endswith(".blk"):
        return
    try:
        ns, key = bytes.fromhex(ns_hex), bytes.fromhex(f.stem)
    except ValueError:
        return  # not ours
    try:
        st = f.stat()
        header = read_header(f)
        if header.total_len != st.st_size:
            raise block_format.Truncated(f"file has {st.st_size} bytes, header promises {header.total_len}")
        if header.namespace != ns:
            raise block_format.ForeignNamespace("block is filed under another namespace")
        if key_of(header) != key:
            raise block_format.WrongBlock("file name is not the block's key")
    except BlockError as e:
        store.quarantine(ns, key, e.reason, f"at recovery: {e}", path=f)
        report["quarantined"] += 1
        return
    except OSError as e:  # unreadable now (EMFILE, EIO, ...) is not bad content: skip it, keep the file
        log.warning("skipping block file %s at recovery: %s", f, e)
        report["skipped"] += 1
        return
    store.index.add(Entry(key=key, ns=ns, kind=header.kind,
                          parent=header.parent if header.kind == "kv" else header.id,
                          start=header.start, tokens=header.tokens, size=st.st_size, atime=st.st_mtime))
    report["blocks"] += 1
    report["bytes"] += st.st_size

