"""The eviction order, exactly as DiskIndex's docstring states it."""

from cluster.store.disk_index import DiskIndex, Entry

NS = b"n" * 32


def k(name: str) -> bytes:
    return name.encode().ljust(32, b"_")


def add(ix, name, parent=None, start=0, atime=0.0, size=10, kind="kv"):
    ix.add(Entry(key=k(name), ns=NS, kind=kind, parent=k(parent) if parent else NS, start=start, tokens=16,
                 size=size, atime=atime))


def names(keys):
    return [key.rstrip(b"_").decode() for key in keys]


def test_lru_then_tails_then_depth_then_key():
    ix = DiskIndex()
    # chain a0 <- a1 <- a2 written at t=1; chain b0 <- b1 at t=1; c0 alone at t=0; a checkpoint at t=1
    add(ix, "c0", atime=0.0)
    add(ix, "a0", atime=1.0)
    add(ix, "a1", "a0", start=16, atime=1.0)
    add(ix, "a2", "a1", start=32, atime=1.0)
    add(ix, "b0", atime=1.0)
    add(ix, "b1", "b0", start=16, atime=1.0)
    add(ix, "s1", "a1", start=16, atime=1.0, kind="state")  # a checkpoint is a tail; it does not make a1 interior
    assert names(ix.eviction_order()) == ["c0", "a2", "b1", "s1", "a1", "a0", "b0"]
    ix.touch(k("c0"), 5.0)
    assert names(ix.eviction_order())[-1] == "c0"


def test_evict_follows_the_order_and_updates_tails():
    ix = DiskIndex()
    add(ix, "a0", atime=1.0)
    add(ix, "a1", "a0", start=16, atime=1.0)
    add(ix, "x", atime=2.0)
    evicted = ix.evict(budget=20)  # 30 bytes: one must go
    assert names(e.key for e in evicted) == ["a1"]
    assert names(ix.eviction_order()) == ["a0", "x"]  # a0 became a tail
    assert ix.bytes == 20


def test_pinned_entries_are_never_evicted():
    ix = DiskIndex()
    for i, t in enumerate([1.0, 2.0, 3.0]):
        add(ix, f"k{i}", atime=t)
    ix.pin(k("k0"))
    ix.pin(k("k0"))
    evicted = ix.evict(budget=10)
    assert names(e.key for e in evicted) == ["k1", "k2"]
    assert ix.evict(budget=0) == [] and k("k0") in ix  # only pinned left
    ix.unpin(k("k0"))
    assert ix.evict(budget=0) == []  # still pinned once
    ix.unpin(k("k0"))
    assert names(e.key for e in ix.evict(budget=0)) == ["k0"]


def test_removing_a_child_makes_its_parent_a_tail_again():
    ix = DiskIndex()
    add(ix, "p", atime=1.0)
    add(ix, "c", "p", start=16, atime=1.0)
    add(ix, "q", atime=1.0)
    assert names(ix.eviction_order()) == ["c", "q", "p"]
    ix.remove(k("c"))
    assert names(ix.eviction_order()) == ["p", "q"]
