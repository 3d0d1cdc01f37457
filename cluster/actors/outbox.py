"""A request's events on their way from the model thread to its stream, gathered into few messages.

Every message a replica yields crosses Ray twice (to the gateway, then to Serve's proxy) and costs
the same CPU however many tokens it carries; every wake-up of the replica's event loop costs a GIL
hand-off with the model thread. So the model thread only appends to a list, and wakes the loop
only when the stream waits for it: for anything at all, or, while a message is being gathered, for
the end alone (or, before the client has seen any text, for text too: the first text never waits).
A decode step then costs the loop nothing; a message costs one wake-up and one timer.
(An asyncio.Queue woke the loop for every token, and a wait_for around each get made a task and a
timer per token.)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from cluster.engine.events import TERMINAL, Delta, Event


def visible(events: list[Event]) -> bool:
    """Whether these events show the client something: text or a tool call."""
    return any(isinstance(e, Delta) and (e.text or e.tool_calls) for e in events)


class Outbox:
    """Filled by the model thread (`put`), emptied by the request's coroutine (`take`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._ended = False
        self._shown = False  # the events waiting hold text or a tool call
        self._waiter: Optional[asyncio.Future] = None
        self._wants = "any"  # what wakes the waiter: "any" event, the "end", or "text" (or the end)

    def put(self, events: list[Event]) -> None:
        """From the model thread: never blocks; a loop already gone means nobody listens."""
        end = any(isinstance(e, TERMINAL) for e in events)
        shown = visible(events)
        with self._lock:
            self._events.extend(events)
            self._ended = self._ended or end
            self._shown = self._shown or shown
            waiter = self._waiter
            if waiter is None or not self._wanted():
                return
            self._waiter = None
        try:
            self._loop.call_soon_threadsafe(_wake, waiter)
        except RuntimeError:  # the loop closed: the request was abandoned
            pass

    async def take(self, hold_until: float = 0.0, until_text: bool = False) -> list[Event]:
        """Everything so far. Waits for the first event, then gathers until loop time `hold_until`,
        unless the end comes first (or, with `until_text`, text or a tool call)."""
        await self._wait("any")
        wait = hold_until - self._loop.time()
        if wait > 0:
            await self._wait("text" if until_text else "end", timeout_s=wait)
        with self._lock:
            events, self._events, self._shown = self._events, [], False
        return events

    def _wanted(self) -> bool:
        """Whether what is here is what the waiter waits for (under the lock)."""
        return self._ended or (self._wants == "any" and bool(self._events)) or (self._wants == "text" and self._shown)

    async def _wait(self, wants: str, timeout_s: Optional[float] = None) -> None:
        with self._lock:
            self._wants = wants
            if self._wanted():
                return
            waiter = self._loop.create_future()
            self._waiter = waiter
        timer = self._loop.call_later(timeout_s, _wake, waiter) if timeout_s is not None else None
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                if self._waiter is waiter:
                    self._waiter = None


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
