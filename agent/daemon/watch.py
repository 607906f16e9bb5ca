"""Stall timers: each socket under back-pressure gets one timer, armed for the moment it would
become `stalled`, so a decision comes within milliseconds of the threshold, not on a tick."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvwatch.sockets import SocketSample
from kvwatch.states import StatePolicy, stall_deadline_ns, stall_since_ns

log = logging.getLogger(__name__)

# The handler returns None when it is done with this stall episode, or a delay in seconds
# after which the socket is to be looked at again (in its grace period, budget exhausted ...).
StallHandler = Callable[[SocketSample], Awaitable[float | None]]
SampleReader = Callable[[int], SocketSample | None]


class StallWatch:
    """Owned by the event loop. Invariants: at most one timer per socket key; a stall
    episode — a socket and the instant its stall conditions began — reaches the handler
    until the handler says it is done with it, and never after."""

    def __init__(self, policy: StatePolicy, read: SampleReader, on_stalled: StallHandler) -> None:
        self.policy = policy
        self.read = read
        self.on_stalled = on_stalled
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._done: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._timers)

    def observe(self, sample: SocketSample) -> None:
        """A fresh look at a socket (an edge event or a scan): arm, move or drop its timer."""
        since = stall_since_ns(sample)
        if not since:
            self.forget(sample.key)
            return
        if self._done.get(sample.key) == since:
            return
        self._arm(sample.key, stall_deadline_ns(sample, self.policy) / 1e9)

    def forget(self, key: int) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._done.pop(key, None)

    def _arm(self, key: int, when_s: float) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_at(max(when_s, loop.time()), self._fire, key)

    def _fire(self, key: int) -> None:
        self._timers.pop(key, None)
        task = asyncio.get_running_loop().create_task(self._check(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, key: int) -> None:
        sample = self.read(key)
        if sample is None:
            self.forget(key)
            return
        since = stall_since_ns(sample)
        deadline = stall_deadline_ns(sample, self.policy)
        if not since:
            self.forget(key)
            return
        if time.monotonic_ns() < deadline:
            self._arm(key, deadline / 1e9)
            return
        try:
            retry = await self.on_stalled(sample)
        except Exception:
            log.exception("stall handler failed for socket %x", key)
            retry = None
        if retry is None:
            self._done[key] = since
        elif key not in self._timers:
            self._arm(key, time.monotonic() + retry)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
