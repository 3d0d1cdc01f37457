from cluster.store.ram_tier import RamTier


def k(i: int) -> bytes:
    return bytes([i]) * 32


def test_lru_eviction_order_is_exact():
    events = []
    t = RamTier(budget_bytes=300, listener=lambda ev, key, data: events.append((ev, key[0], len(data))))
    for i in range(3):
        assert t.put(k(i), b"x" * 100)
    t.get(k(0))                      # 0 becomes most recent: order 1, 2, 0
    assert t.exists(k(1))            # exists() is not a use
    assert t.prefix_hits([k(1), k(2)]) == 2  # nor is prefix_hits()
    t.put(k(3), b"y" * 150)          # needs 150: evicts 1, then 2
    assert t.keys() == [k(0), k(3)]
    assert [e for e in events if e[0] == "evicted"] == [("evicted", 1, 100), ("evicted", 2, 100)]
    assert t.stats() == {"blocks": 2, "bytes": 250, "budget": 300, "hits": 1, "misses": 0, "evictions": 2, "rejected": 0}


def test_budget_is_never_exceeded_and_oversized_blocks_are_refused():
    t = RamTier(budget_bytes=1000)
    for i in range(50):
        t.put(k(i), b"z" * (37 * (i % 7) + 1))
        assert t.stats()["bytes"] <= 1000
    assert not t.put(k(200), b"q" * 1001)
    assert t.stats()["rejected"] == 1


def test_prefix_hits_counts_from_the_start():
    t = RamTier(10_000)
    for i in (0, 1, 2, 4):
        t.put(k(i), b"a")
    assert t.prefix_hits([k(i) for i in range(6)]) == 3
    assert t.prefix_hits([k(5), k(0)]) == 0


def test_put_twice_costs_nothing_and_remove_emits():
    events = []
    t = RamTier(1000, listener=lambda ev, key, data: events.append(ev))
    t.put(k(1), b"abc")
    t.put(k(1), b"abc")
    assert events == ["stored"] and t.stats()["bytes"] == 3
    assert t.remove(k(1)) and not t.remove(k(1))
    assert events == ["stored", "evicted"] and t.get(k(1)) is None and t.stats()["misses"] == 1
