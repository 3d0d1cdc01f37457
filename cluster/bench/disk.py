"""The disk tier against `dd` on the same disk, in the same run; and recovery time at scale.

    mlx-fleet bench disk [--dir DIR] [--blocks 48] [--recovery-blocks 50000] [--json out.json]

throughput: N blocks of the Qwen3-0.6B KV geometry (64 tokens, ~14 MiB each, f32)
  write: DiskStore.write_many (temp file, fsync, rename, directory fsync, index)
         vs  dd if=/dev/zero of=FILE bs=14M count=N conv=fsync   (same bytes, one fsync)
  read:  a restore's read path (pin, read each file, verify checksums, unpin)
         vs  dd if=FILE of=/dev/null bs=14M
  Page cache: before every read pass the files' cached pages are dropped with
  posix_fadvise(DONTNEED) (Linux), so both read from the device; where that is
  not available the run says "warm" and both read from memory.
recovery: start a DiskStore over `recovery-blocks` small blocks (index rebuilt from
  headers), cold page cache as above. Reported: blocks found, seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from cluster.bench.codec import geometry_caches
from cluster.bench.common import parser, write_json
from cluster.kvcache.disk_client import DiskClient
from cluster.kvcache.store_link import LocalLink
from cluster.families.codecs import codec_descriptor
from cluster.store import block_format as bf
from cluster.store.disk_tier import DiskStore
from cluster.store.hashing import chain_ids


def drop_cache(paths: list[Path]) -> bool:
    """Evict these files from the page cache; False where the OS offers no way to."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd) if hasattr(os, "fdatasync") else None
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_bandwidth(paths: list[Path], threads: int = 4) -> float | None:
    """Bytes/s of reading these files with `threads` readers (as a restore reads), page cache dropped first;
    None where it cannot be dropped (the figure would be memory's)."""
    if not paths or not drop_cache(paths):
        return None

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as f:
            return sum(len(chunk) for chunk in iter(lambda: f.read(8 << 20), b""))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, paths))
    return total / (time.perf_counter() - t0)


def dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def geometry_blocks(n: int) -> list[tuple[bytes, bytes, object]]:
    pc, caches, prompt = geometry_caches("qwen3-0.6b", n * 64, 64)
    ids = chain_ids(pc.namespace, prompt, 64)
    out = []
    for j, bid in enumerate(ids):
        pc.store_block(j, bid, ids[j - 1] if j else pc.namespace, prompt[j * 64:(j + 1) * 64], caches)
        pc.seal()
        out.append((pc.namespace, bid, pc.envelope(bid)))
        pc.tiers.ram.discard(bid)  # keep memory flat: one block in RAM at a time
    mx.clear_cache()
    return out


def throughput(work: Path, n: int) -> dict:
    blocks = geometry_blocks(n)
    size = len(blocks[0][2])
    total = sum(len(d) for _, _, d in blocks)
    store = DiskStore(work / "node", budget=total * 2)
    t0 = time.perf_counter()
    for item in blocks:  # one block per call, as spills arrive
        store.write_many([item])
    t_write = time.perf_counter() - t0
    dd_file = work / "dd.bin"
    t_dd_write = dd(["if=/dev/zero", f"of={dd_file}", f"bs={size}", f"count={n}", "conv=fsync"])

    ns, keys = blocks[0][0], [k for _, k, _ in blocks]
    files = [store.path(ns, k) for k in keys]
    cold = drop_cache(files)
    client = DiskClient(LocalLink(store), ns)
    t0 = time.perf_counter()
    got = client.get_many(keys)
    t_read = time.perf_counter() - t0
    client.close()
    assert all(g is not None for g in got)
    drop_cache([dd_file])
    t_dd_read = dd([f"if={dd_file}", "of=/dev/null", f"bs={size}"])
    return {"blocks": n, "block_bytes": size, "bytes": total, "page_cache": "dropped" if cold else "warm",
            "write_gbps": total / t_write / 1e9, "dd_write_gbps": total / t_dd_write / 1e9,
            "read_gbps": total / t_read / 1e9, "dd_read_gbps": total / t_dd_read / 1e9,
            "write_vs_dd": t_dd_write / t_write, "read_vs_dd": t_dd_read / t_read}


def recovery(work: Path, n: int) -> dict:
    """n distinct small blocks written straight to their final names (setup only), then a timed start."""
    root = work / "recovery"
    ns = bytes(range(32))
    tokens = np.arange(n * 16, dtype=np.uint32) % 60000 + (np.arange(n * 16, dtype=np.uint32) // 60000)
    ids = chain_ids(ns, tokens.tolist(), 16)
    store_root = root / "blocks" / ns.hex()
    payload = [("float32", np.zeros(64, np.float32))]
    files = []
    for j, bid in enumerate(ids):
        blk = bf.Block(kind="kv", namespace=ns, id=bid, parent=ids[j - 1] if j else ns, start=j * 16,
                       tokens=tokens[j * 16:(j + 1) * 16], layout=[["full"]], dtype="float32",
                       codec=codec_descriptor("native", 64), entries=[payload])
        path = store_root / bid.hex()[:2] / f"{bid.hex()}.blk"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bf.encode(blk))
        files.append(path)
    cold = drop_cache(files)
    t0 = time.perf_counter()
    store = DiskStore(root, budget=1 << 40)
    seconds = time.perf_counter() - t0
    assert store.recovery["blocks"] == n
    return {"blocks": n, "seconds": seconds, "per_block_us": seconds / n * 1e6,
            "page_cache": "dropped" if cold else "warm"}


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--dir", type=Path, default=None, help="where to measure (default: a temp dir under the data dir)")
    p.add_argument("--blocks", type=int, default=48, help="~14 MiB blocks written and read")
    p.add_argument("--recovery-blocks", type=int, default=50_000, help="small blocks the recovery run starts over")
    a = p.parse_args(argv)
    base = a.dir or a.data_dir
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=base))
    try:
        t = throughput(work, a.blocks)
        print(f"throughput, {t['blocks']} blocks of {t['block_bytes'] / 2**20:.1f} MiB, page cache {t['page_cache']}:")
        print(f"  write  store {t['write_gbps']:.2f} GB/s   dd {t['dd_write_gbps']:.2f} GB/s   store/dd {t['write_vs_dd']:.2f}")
        print(f"  read   store {t['read_gbps']:.2f} GB/s   dd {t['dd_read_gbps']:.2f} GB/s   store/dd {t['read_vs_dd']:.2f}"
              "  (goal >= 0.50)")
        r = recovery(work, a.recovery_blocks)
        print(f"recovery: {r['blocks']} blocks indexed in {r['seconds']:.2f}s ({r['per_block_us']:.0f} us/block, "
              f"page cache {r['page_cache']})")
        write_json(a.json, "disk", {"throughput": t, "recovery": r})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0
