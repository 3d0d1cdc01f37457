from cluster.store.contract import leading
from cluster.store.ram_tier import RamTier


def k(i: int) -> bytes:
    return bytes([i]) * 32


def test_lru_eviction_order_is_exact():
    events = []
    t = RamTier(budget_bytes=300, listener=lambda ev, key, data: events.append((ev, key[0], len(data))))
    for i in range(3):
        assert t.put(k(i), b"x" * 100)
    t.get_many([k(0)])               # 0 becomes most recent: order 1, 2, 0
    assert t.present([k(1), k(2)]) == [True, True]  # present() is not a use
    t.put(k(3), b"y" * 150)          # needs 150: evicts 1, then 2
    assert t.keys() == [k(0), k(3)]
    assert [e for e in events if e[0] == "evicted"] == [("evicted", 1, 100), ("evicted", 2, 100)]
    assert t.stats() == {"blocks": 2, "bytes": 250, "budget": 300, "hits": 1, "misses": 0, "evictions": 2,
                         "rejected": 0, "discarded": 0}


def test_budget_is_never_exceeded_and_oversized_blocks_are_refused():
    t = RamTier(budget_bytes=1000)
    for i in range(50):
        t.put(k(i), b"z" * (37 * (i % 7) + 1))
        assert t.stats()["bytes"] <= 1000
    assert not t.put(k(200), b"q" * 1001)
    assert t.stats()["rejected"] == 1


def test_leading_presence_counts_from_the_start():
    t = RamTier(10_000)
    for i in (0, 1, 2, 4):
        t.put(k(i), b"a")
    assert leading(t.present([k(i) for i in range(6)])) == 3
    assert leading(t.present([k(5), k(0)])) == 0


def test_put_twice_costs_nothing_and_discard_emits_without_spilling():
    events = []
    t = RamTier(1000, listener=lambda ev, key, data: events.append(ev))
    t.put(k(1), b"abc")
    t.put(k(1), b"abc")
    assert events == ["stored"] and t.stats()["bytes"] == 3
    assert t.discard(k(1), "payload") and not t.discard(k(1), "payload")
    assert events == ["stored", "discarded"] and t.get_many([k(1)]) == [None]
    assert (t.stats()["misses"], t.stats()["discarded"], t.stats()["bytes"]) == (1, 1, 0)
