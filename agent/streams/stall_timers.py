"""Stall timers: each socket on its way to a stall gets one timer, armed for the moment the
judge's verdict can next change, so a decision comes within milliseconds of it, not on a tick.
Before that, with `park_seconds`, the timer also fires once the stall conditions have held
that long: the pressure handler (the park) gets its turn, once per episode."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvwatch.sockets import SocketSample
from kvwatch.streams.states import StallJudgement, StallThresholds, judge

log = logging.getLogger(__name__)

# The handler returns None when it is done with this stall episode, or a delay in seconds
# after which the socket is to be looked at again (in its grace period, budget exhausted ...).
StallHandler = Callable[[SocketSample, StallJudgement], Awaitable[float | None]]
SampleReader = Callable[[int], Awaitable[SocketSample | None]]
# A handler that raised is tried again this much later (and at every observation before).
RETRY_AFTER_ERROR_SECONDS = 1.0


def episode_of(sample: SocketSample) -> int:
    """A stall episode lasts while nothing is acknowledged: the kernel's cumulative
    bytes_acked names it, whichever view (BPF, sock_diag, carried over) the sample is."""
    return sample.bytes_acked


class StallTimers:
    """Owned by the event loop. Invariants: at most one timer and at most one check in flight
    per socket key; a stall episode reaches the handler until the handler says it is done
    with it, and never after; a handler that raised has not finished its episode; a socket
    observed while its check runs is looked at again when that check ends. With
    `on_pressure`, an episode whose stall conditions have held `park_seconds` (and that is
    not stalled yet) reaches it in the same way, until it says it is done with the episode."""

    def __init__(
        self,
        thresholds: StallThresholds,
        read: SampleReader,
        on_stalled: StallHandler,
        *,
        on_pressure: StallHandler | None = None,
        park_seconds: float = 0.0,
    ) -> None:
        self.thresholds = thresholds
        self.read = read
        self.on_stalled = on_stalled
        self.on_pressure = on_pressure
        self.park_ns = int(park_seconds * 1e9)
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._done: dict[int, int] = {}
        self._pressure_done: dict[int, int] = {}
        self._checking: set[int] = set()
        self._seen_while_checking: dict[int, int] = {}  # key -> newest episode observed
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._timers)

    def observe(self, sample: SocketSample) -> None:
        """A fresh look at a socket (an edge event or a scan): arm, move or drop its timer."""
        now_ns = time.monotonic_ns()
        judgement = judge(sample, now_ns, self.thresholds)
        if not judgement.on_the_way:
            self.forget(sample.key)
            return
        if sample.key in self._checking:
            self._seen_while_checking[sample.key] = episode_of(sample)
            return
        if self._done.get(sample.key) == episode_of(sample):
            return
        self._arm(sample.key, self._next_ns(sample, judgement, now_ns))

    def _pressure_due_ns(self, sample: SocketSample, judgement: StallJudgement) -> int:
        """When the pressure handler is due for this episode; 0 when it is not (none, or
        it is done with the episode)."""
        if self.on_pressure is None or self._pressure_done.get(sample.key) == episode_of(sample):
            return 0
        return judgement.since_ns + self.park_ns

    def _next_ns(self, sample: SocketSample, judgement: StallJudgement, now_ns: int) -> int:
        """The next look: when the verdict can change, or the pressure handler is due."""
        next_ns = judgement.recheck_ns or now_ns
        pressure_ns = self._pressure_due_ns(sample, judgement)
        return min(next_ns, max(pressure_ns, now_ns)) if pressure_ns else next_ns

    def forget(self, key: int) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._done.pop(key, None)
        self._pressure_done.pop(key, None)
        self._seen_while_checking.pop(key, None)

    def _arm(self, key: int, when_ns: int) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_at(max(when_ns / 1e9, loop.time()), self._fire, key)

    def _fire(self, key: int) -> None:
        self._timers.pop(key, None)
        if key in self._checking:
            return
        self._checking.add(key)
        task = asyncio.get_running_loop().create_task(self._check(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, key: int) -> None:
        try:
            sample = await self.read(key)
            now_ns = time.monotonic_ns()
            judgement = judge(sample, now_ns, self.thresholds) if sample is not None else None
            if sample is None or judgement is None or not judgement.on_the_way:
                self.forget(key)
                return
            if self._done.get(key) == episode_of(sample):
                return
            if not judgement.stalled:
                await self._pressure(sample, judgement, now_ns)
                return
            retry = await self._handle(self.on_stalled, sample, judgement)
            if retry is None:
                self._done[key] = episode_of(sample)
            else:
                self._arm(key, time.monotonic_ns() + int(retry * 1e9))
        finally:
            self._checking.discard(key)
            # A socket observed during the check may show an episode the check did not
            # finish: look again now, unless a timer is already set for it.
            seen = self._seen_while_checking.pop(key, None)
            if seen is not None and seen != self._done.get(key) and key not in self._timers:
                self._arm(key, time.monotonic_ns())

    async def _pressure(self, sample: SocketSample, judgement: StallJudgement, now_ns: int) -> None:
        """A socket not stalled yet: the pressure handler if it is due, then the next look."""
        due_ns = self._pressure_due_ns(sample, judgement)
        if self.on_pressure is None or not due_ns or now_ns < due_ns:
            self._arm(sample.key, self._next_ns(sample, judgement, now_ns))
            return
        retry = await self._handle(self.on_pressure, sample, judgement)
        if retry is None:
            self._pressure_done[sample.key] = episode_of(sample)
            self._arm(sample.key, judgement.recheck_ns or now_ns)
        else:
            retry_ns = time.monotonic_ns() + int(retry * 1e9)
            self._arm(sample.key, min(retry_ns, judgement.recheck_ns or retry_ns))

    async def _handle(
        self, handler: StallHandler, sample: SocketSample, judgement: StallJudgement
    ) -> float | None:
        try:
            return await handler(sample, judgement)
        except Exception:
            log.exception("stall handler failed for socket %x; trying again", sample.key)
            return RETRY_AFTER_ERROR_SECONDS

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
