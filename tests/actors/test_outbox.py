"""The hand-off from the model thread to a request's stream: gathered, woken only when needed."""

import asyncio
import threading

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


def test_tokens_put_while_a_message_gathers_wake_the_loop_once_not_per_token():
    async def main():
        loop = asyncio.get_running_loop()
        wakes = counted(loop)
        box = Outbox(loop)
        from_thread(box.put, [delta(0)])  # nobody waits yet: no wake-up
        first = await box.take()
        taking = asyncio.ensure_future(box.take(loop.time() + 0.3))
        await asyncio.sleep(0.05)
        for i in range(1, 6):
            from_thread(box.put, [delta(i)])  # the first wakes the stream; then it waits for the end only
        second = await asyncio.wait_for(taking, 5)
        return first, second, len(wakes)

    first, second, wakes = asyncio.run(main())
    assert first == [delta(0)]
    assert second == [delta(i) for i in range(1, 6)]
    assert wakes == 1


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


def test_a_cancelled_stream_and_a_closed_loop_leave_the_model_thread_unharmed():
    async def main():
        box = Outbox(asyncio.get_running_loop())
        taking = asyncio.ensure_future(box.take())
        await asyncio.sleep(0.01)
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
        box.put([delta(0)])  # no waiter any more
        return box

    box = asyncio.run(main())
    from_thread(box.put, [delta(1), finished()])  # the loop is closed: dropped, no exception
