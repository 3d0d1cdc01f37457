"""Real faults: a writer killed with SIGKILL mid-write, and a filesystem that fills up."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.store.disk_tier import DiskStore
from tests.store.blocks import NS, chain

WRITER = """
import sys
from pathlib import Path
from cluster.store.disk_tier import DiskStore
from tests.store.blocks import chain
store = DiskStore(Path(sys.argv[1]), budget=1 << 34)
print("ready", flush=True)
i = 0
while True:
    store.write_many(chain(2, salt=i, payload=2 << 20))  # 2 MiB blocks: a wide window to die in
    i += 1
"""


def test_kill_9_during_writes_leaves_no_partial_block(tmp_path):
    root = Path(__file__).resolve().parents[2]
    for attempt in range(3):
        node = tmp_path / f"node{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(node)], stdout=subprocess.PIPE, cwd=root)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.8 + 0.37 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        blocks_dir = node / "blocks"
        temps = list(blocks_dir.rglob("*.tmp"))
        finals = list(blocks_dir.rglob("*.blk"))
        assert finals, "the writer published nothing before it was killed"
        store = DiskStore(node, budget=1 << 34)
        r = store.recovery
        assert r["quarantined"] == 0, "a partial block became visible under a final name"
        assert r["blocks"] == len(finals) and r["temp_removed"] == len(temps)
        assert not list(blocks_dir.rglob("*.tmp"))
        keys = list(store.index.entries)
        assert all(d is not None for d in store.read_many(NS, keys))  # every visible block verifies


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs: disk full for real (needs root; skipped elsewhere)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_pauses_spilling_and_it_resumes_when_space_returns(small_fs):
    clock = [0.0]
    store = DiskStore(small_fs / "node", budget=1 << 30, clock=lambda: clock[0])  # budget above the fs size
    blocks = chain(12, payload=120 << 10)  # ~120 KiB each: the 1 MiB filesystem fills after ~8
    out = store.write_many(blocks)
    assert out["written"] >= 5 and out["dropped"] >= 1
    assert store.degraded and store.degraded["reason"] == os.strerror(28)  # ENOSPC
    written = [k for _, k, _ in blocks if k in store.index]
    assert all(d is not None for d in store.read_many(NS, written))  # serving from disk goes on
    assert not list((small_fs / "node" / "blocks").rglob("*.tmp"))
    dropped_before = store.counters["dropped_spills"]
    assert store.write_many(chain(1, salt=7, payload=1024))["dropped"] == 1  # paused: no retry yet
    assert store.counters["dropped_spills"] == dropped_before + 1
    for k in written[:6]:  # space returns
        store.path(NS, k).unlink()
        store.index.remove(k)
    clock[0] += 10  # past the back-off
    assert store.write_many(chain(1, salt=8, payload=1024))["written"] == 1
    assert store.degraded is None
    assert store.stats()["write_errors"] >= 1
