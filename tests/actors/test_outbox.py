"""The hand-off from the model thread to a request's stream: gathered, woken only when needed."""

import asyncio
import threading
import time

from cluster.actors.outbox import Outbox
from cluster.engine.events import Delta, Finished


def delta(i: int) -> Delta:
    return Delta(f"t{i}", (i,))


def finished() -> Finished:
    return Finished("length", 3, 0, 0)


def counted(loop: asyncio.AbstractEventLoop) -> list:
    """Record the loop's wake-ups from other threads (the real loop still does the work)."""
    calls = []
    real = loop.call_soon_threadsafe

    def call_soon_threadsafe(*args):
        calls.append(args)
        return real(*args)

    loop.call_soon_threadsafe = call_soon_threadsafe
    return calls


def from_thread(fn, *args) -> None:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


def test_the_first_events_wake_the_stream_at_once():
    async def main():
        box = Outbox(asyncio.get_running_loop())
        later = asyncio.get_running_loop().call_later(0.05, lambda: from_thread(box.put, [delta(0)]))
        got = await asyncio.wait_for(box.take(), 5)
        later.cancel()
        return got

    assert asyncio.run(main()) == [delta(0)]


def producer(box: Outbox, batches: list, gap_s: float = 0.02) -> threading.Thread:
    """A model thread putting `batches` while the loop runs (gap_s apart)."""
    def run():
        for events in batches:
            time.sleep(gap_s)
            box.put(events)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_tokens_put_while_a_message_gathers_wake_the_loop_once_not_per_token():
    async def main():
        loop = asyncio.get_running_loop()
        wakes = counted(loop)
        box = Outbox(loop)
        box.put([delta(0)])
        first = await box.take()
        t0 = loop.time()
        thread = producer(box, [[delta(i)] for i in range(1, 6)])  # 0.1 s of tokens, inside the 0.3 s hold
        second = await asyncio.wait_for(box.take(t0 + 0.3), 5)
        thread.join()
        return first, second, loop.time() - t0, len(wakes)

    first, second, waited, wakes = asyncio.run(main())
    assert first == [delta(0)]
    assert second == [delta(i) for i in range(1, 6)]  # gathered into one message, at the hold's end
    assert waited >= 0.29
    assert wakes == 1  # the first token of the message; the other four found the stream waiting for the end


def test_before_any_text_a_message_goes_as_soon_as_text_comes():
    async def main():
        loop = asyncio.get_running_loop()
        box = Outbox(loop)
        t0 = loop.time()
        thread = producer(box, [[Delta("", (1,))], [Delta("", (2,))], [delta(3)], [delta(4)]])
        got = await asyncio.wait_for(box.take(t0 + 30, until_text=True), 5)  # a hold far longer than the test
        thread.join()
        rest = await box.take()
        return got, rest, loop.time() - t0

    got, rest, waited = asyncio.run(main())
    assert got[-1] == delta(3) and [e.token_ids for e in got][:2] == [(1,), (2,)]
    assert rest == [delta(4)]
    assert waited < 5


def test_the_end_cuts_a_gathering_message_short():
    async def main():
        loop = asyncio.get_running_loop()
        box = Outbox(loop)
        box.put([delta(0)])
        t0 = loop.time()
        taking = asyncio.ensure_future(box.take(t0 + 30))  # a hold far longer than the test
        await asyncio.sleep(0.05)
        from_thread(box.put, [delta(1), finished()])
        got = await asyncio.wait_for(taking, 5)
        return got, loop.time() - t0

    got, waited = asyncio.run(main())
    assert got == [delta(0), delta(1), finished()]
    assert waited < 5


def test_a_cancelled_stream_leaves_no_waiter_and_a_closed_loop_leaves_the_model_thread_unharmed():
    async def main():
        box = Outbox(asyncio.get_running_loop())
        taking = asyncio.ensure_future(box.take())
        await asyncio.sleep(0.01)
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
        assert box._waiter is None
        box.put([delta(0)])  # nobody to wake

    asyncio.run(main())
    loop = asyncio.new_event_loop()
    box = Outbox(loop)
    box._waiter = loop.create_future()  # a stream that was waiting when its loop went away
    loop.close()
    box.put([delta(1), finished()])  # dropped, no exception
