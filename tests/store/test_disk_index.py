"""The eviction order, exactly as DiskIndex's docstring states it, pinned through evict() itself."""

from cluster.store.disk_index import DiskIndex, Entry

NS = b"n" * 32


def k(name: str) -> bytes:
    return name.encode().ljust(32, b"_")


def add(ix, name, parent=None, start=0, atime=0.0, size=10, kind="kv"):
    ix.add(Entry(key=k(name), ns=NS, kind=kind, parent=k(parent) if parent else NS, start=start, tokens=16,
                 size=size, atime=atime))


def names(entries):
    return [e.key.rstrip(b"_").decode() for e in entries]


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
    # Removing a tail makes its parent a tail: the order is re-evaluated after every victim.
    assert names(ix.evict(budget=0)) == ["c0", "a2", "a1", "b1", "s1", "a0", "b0"]
    assert ix.bytes == 0 and len(ix) == 0


def test_a_touch_moves_an_entry_to_the_back_and_never_back_in_time():
    ix = DiskIndex()
    for i, name in enumerate(["x", "y", "z"]):
        add(ix, name, atime=float(i))
    ix.touch(k("x"), 5.0)
    ix.touch(k("y"), 0.5)  # older than its last use: ignored
    assert names(ix.evict(budget=0)) == ["y", "z", "x"]


def test_evict_stops_as_soon_as_it_fits():
    ix = DiskIndex()
    add(ix, "a0", atime=1.0)
    add(ix, "a1", "a0", start=16, atime=1.0)
    add(ix, "x", atime=2.0)
    assert names(ix.evict(budget=20)) == ["a1"]  # 30 bytes: one must go
    assert ix.bytes == 20 and set(ix.entries) == {k("a0"), k("x")}
    assert names(ix.evict(budget=20, incoming=10)) == ["a0"]  # a0 became a tail


def test_pinned_entries_are_never_evicted():
    ix = DiskIndex()
    for i, t in enumerate([1.0, 2.0, 3.0]):
        add(ix, f"k{i}", atime=t)
    ix.pin(k("k0"))
    ix.pin(k("k0"))
    assert names(ix.evict(budget=10)) == ["k1", "k2"]
    assert ix.evict(budget=0) == [] and k("k0") in ix  # only pinned left
    ix.unpin(k("k0"))
    assert ix.evict(budget=0) == []  # still pinned once
    ix.unpin(k("k0"))
    assert names(ix.evict(budget=0)) == ["k0"]


def test_removing_a_child_makes_its_parent_a_tail_again():
    ix = DiskIndex()
    add(ix, "p", atime=1.0)
    add(ix, "c", "p", start=16, atime=1.0)
    add(ix, "q", atime=1.0)
    ix.remove(k("c"))
    assert names(ix.evict(budget=0)) == ["p", "q"]


def test_the_order_holds_one_item_per_entry_however_often_entries_are_touched():
    ix = DiskIndex()
    for i in range(100):
        add(ix, f"e{i}", atime=0.0)
    for t in range(1, 2001):
        ix.touch(k(f"e{t % 100}"), float(t))
    assert ix.order_size() == len(ix) == 100
    for i in range(50):
        ix.remove(k(f"e{i}"))
    assert ix.order_size() == len(ix) == 50
