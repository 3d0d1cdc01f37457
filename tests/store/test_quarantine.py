"""Quarantine is for bad content only, counts against the disk budget, and is itself bounded."""

import subprocess
import sys
from pathlib import Path

from cluster.store import quarantine as quarantine_mod
from cluster.store.block_files import read_verified
from cluster.store.disk_tier import DiskStore
from tests.store.blocks import NS, chain


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-50] ^= 1
    path.write_bytes(bytes(data))


def quarantined_files(node: Path) -> list[Path]:
    return sorted((node / "quarantine").glob("*/*.blk"))


def test_a_block_evicted_behind_the_readers_back_is_a_miss_not_a_quarantine(tmp_path):
    events = []
    s = DiskStore(tmp_path / "node", budget=1 << 30, listener=events.append)
    blocks = chain(2)
    s.write_many(blocks)
    s.path(*blocks[1][:2]).unlink()  # ENOENT: gone, not bad
    got = s.read_many(NS, [k for _, k, _ in blocks])
    assert got[0] is not None and got[1] is None
    assert sum(s.stats()["quarantined"].values()) == 0 and quarantined_files(tmp_path / "node") == []
    assert blocks[1][1] not in s.index and events[-1].event == "evicted" and events[-1].key == blocks[1][1]
    assert s.stats()["read_errors"] == 1


def test_negative_control_a_corrupt_block_is_quarantined(tmp_path):
    s = DiskStore(tmp_path / "node", budget=1 << 30)
    blocks = chain(2)
    s.write_many(blocks)
    corrupt(s.path(*blocks[1][:2]))
    assert s.read_many(NS, [blocks[1][1]]) == [None]
    assert s.stats()["quarantined"]["payload"] == 1 and len(quarantined_files(tmp_path / "node")) == 1


EMFILE_READER = """
import resource, sys
from pathlib import Path
from cluster.store.disk_tier import DiskStore
from tests.store.blocks import NS, chain
s = DiskStore(Path(sys.argv[1]), budget=1 << 30)
blocks = chain(2)
s.write_many(blocks)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
held = []
try:
    while True:
        held.append(open("/dev/null"))
except OSError:
    pass  # every descriptor is taken: the next open fails with EMFILE
got = s.read_many(NS, [k for _, k, _ in blocks])
for f in held:
    f.close()
print(sum(g is None for g in got), sum(s.stats()["quarantined"].values()), len(s.index), s.stats()["read_errors"])
"""


def test_too_many_open_files_is_a_miss_not_a_quarantine(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", EMFILE_READER, str(tmp_path / "node")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    misses, quarantined, kept, errors = map(int, out.stdout.split())
    assert (misses, quarantined, kept, errors) == (2, 0, 2, 2)  # both unreadable, both kept, none quarantined
    assert quarantined_files(tmp_path / "node") == []


def test_the_quarantine_keeps_only_its_newest_files_within_its_limit(tmp_path):
    blocks = chain(6)
    size = len(blocks[0][2])
    q = quarantine_mod.Quarantine(tmp_path / "quarantine", limit=3 * size)
    for i, (ns, key, data) in enumerate(blocks):
        src = tmp_path / f"{key.hex()}.blk"
        src.write_bytes(data)
        q.add(src, ns, key, "payload", "test", now=1000.0 + i)
    kept = sorted(p.name for p in (tmp_path / "quarantine" / "payload").iterdir())
    assert kept == sorted(f"{NS.hex()[:16]}-{k.hex()}.blk" for _, k, _ in blocks[3:])  # the oldest went first
    assert (q.bytes, q.deleted, len(q)) == (3 * size, 3, 3)
    again = quarantine_mod.Quarantine(tmp_path / "quarantine", limit=size)  # a restart with a smaller bound
    assert (len(again), again.bytes) == (1, size)
    assert len((tmp_path / "quarantine" / "log.jsonl").read_text().splitlines()) == 6


def test_quarantined_bytes_count_against_the_disk_budget(tmp_path):
    blocks = chain(44)
    size = len(blocks[0][2])
    s = DiskStore(tmp_path / "node", budget=40 * size)  # quarantine limit: 5% = 2 blocks
    s.write_many(blocks[:40])
    for _, key, _ in blocks[:2]:
        corrupt(s.path(NS, key))
    assert s.read_many(NS, [k for _, k, _ in blocks[:2]]) == [None, None]
    assert s.quarantine_bin.bytes == 2 * size and s.index.bytes == 38 * size
    s.write_many(blocks[40:44])  # room for 2 only: the quarantine takes the other 2
    assert s.index.bytes + s.quarantine_bin.bytes == s.budget == s.stats()["bytes"] + s.stats()["quarantine"]["bytes"]
    assert len(s.index) == 38


def test_a_block_already_quarantined_by_another_reader_is_counted_once(tmp_path):
    s = DiskStore(tmp_path / "node", budget=1 << 30)
    blocks = chain(1)
    s.write_many(blocks)
    corrupt(s.path(*blocks[0][:2]))
    located = [s.open_read(NS, [blocks[0][1]]) for _ in range(2)]  # two readers pin it before either reads
    assert all(loc[0] for loc in located)
    for _ in range(2):
        s.close_read(NS, [blocks[0][1]], [], [read_verified(located[0][0], NS, blocks[0][1])[1]])
    assert s.stats()["quarantined"]["payload"] == 1 and len(quarantined_files(tmp_path / "node")) == 1


def test_a_late_report_of_a_bad_read_leaves_the_good_copy_spilled_since(tmp_path):
    """Two readers read the bad file; the first one's report moves it, a replica spills its intact RAM copy
    under the same name, then the second report comes: it names the file it read (by inode), which is gone,
    so the good copy stays, indexed and readable, and the bad block is counted once."""
    s = DiskStore(tmp_path / "node", budget=1 << 30)
    blocks = chain(1)
    (_, key, _), = blocks
    s.write_many(blocks)
    corrupt(s.path(NS, key))
    located = [s.open_read(NS, [key]) for _ in range(2)]
    failures = [read_verified(loc[0], NS, key)[1] for loc in located]  # both read the bad bytes
    assert all(f.bad_content and f.file_id is not None for f in failures)
    s.close_read(NS, [key], [], [failures[0]])
    assert key not in s.index and not s.path(NS, key).exists()
    assert s.write_many(blocks)["written"] == 1  # the good copy, spilled again
    s.close_read(NS, [key], [], [failures[1]])
    assert key in s.index and s.read_many(NS, [key])[0] is not None
    assert s.stats()["quarantined"]["payload"] == 1 and len(quarantined_files(tmp_path / "node")) == 1


def test_the_log_rotates(tmp_path, monkeypatch):
    monkeypatch.setattr(quarantine_mod, "LOG_BYTES", 200)
    q = quarantine_mod.Quarantine(tmp_path / "q", limit=1 << 20)
    for i in range(5):
        src = tmp_path / f"{i}.blk"
        src.write_bytes(b"bad")
        q.add(src, NS, bytes([i]) * 32, "payload", "x" * 50, now=float(i))
    assert (tmp_path / "q" / "log.jsonl.1").exists() and (tmp_path / "q" / "log.jsonl").stat().st_size < 400
