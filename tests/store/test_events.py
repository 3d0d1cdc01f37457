"""The event log: every event exactly once, in order; a consumer that fell behind is told so."""

from cluster.store.events import BlockEvent, EventLog

NS = b"n" * 32


def ev(i: int) -> BlockEvent:
    return BlockEvent("stored", "disk", NS, i.to_bytes(32, "big"), NS, 16, 100)


def keys(events) -> list[int]:
    return [int.from_bytes(e.key, "big") for e in events]


def test_a_consumer_sees_every_event_once_in_order_across_many_wraps():
    log = EventLog(capacity=5)
    seen, cursor, epoch = [], 0, None
    for i in range(1, 38):
        log.append(ev(i))
        if i % 3 == 0:  # reads every third event: never more than 5 behind
            batch = log.since(cursor, limit=2, epoch=epoch)
            while batch.events:
                assert not batch.gap
                seen += keys(batch.events)
                cursor, epoch = batch.cursor, batch.epoch
                batch = log.since(cursor, limit=2, epoch=epoch)
    assert seen == list(range(1, 37))
    assert log.since(cursor, epoch=epoch).events[0].key == ev(37).key


def test_a_consumer_that_fell_behind_gets_a_gap_and_the_oldest_kept_events():
    log = EventLog(capacity=4)
    for i in range(1, 11):
        log.append(ev(i))
    batch = log.since(3)  # events 4..6 are gone
    assert batch.gap and keys(batch.events) == [7, 8, 9, 10] and batch.cursor == 10
    after = log.since(batch.cursor, epoch=batch.epoch)
    assert not after.gap and after.events == [] and after.cursor == 10


def test_negative_control_an_up_to_date_consumer_sees_no_gap():
    log = EventLog(capacity=4)
    for i in range(1, 11):
        log.append(ev(i))
    batch = log.since(6)  # 7 is the oldest kept: nothing missed
    assert not batch.gap and keys(batch.events) == [7, 8, 9, 10]


def test_a_restarted_log_is_a_gap_even_if_its_numbers_look_fine():
    old = EventLog()
    for i in range(1, 6):
        old.append(ev(i))
    cursor, epoch = old.since(0).cursor, old.epoch
    new = EventLog()  # the store restarted: numbering starts again
    for i in range(1, 9):
        new.append(ev(100 + i))
    batch = new.since(cursor, epoch=epoch)
    assert batch.gap and keys(batch.events) == list(range(101, 109))
    assert new.since(99, epoch=new.epoch).gap  # a cursor ahead of the log
