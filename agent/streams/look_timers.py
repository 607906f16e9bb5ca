"""Look timers: each socket the agent follows gets one timer, armed for the moment something
about it can next change (the judge's verdict, a hold's milestones: kvwatch.act.episode_runner
says when), so a decision comes within milliseconds of it, not on a tick."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# A look at socket `key`: returns when to look again (monotonic ns), or None when there is
# nothing to follow until a new observation arms the timer again.
LookHandler = Callable[[int], Awaitable[int | None]]
# A look that raised is tried again this much later (or at an observation before).
RETRY_AFTER_ERROR_SECONDS = 1.0


class LookTimers:
    """Owned by the event loop. Invariants: at most one timer and at most one look in flight
    per socket key; a socket armed while its look runs is looked at again when that look
    ends (the look may have missed what armed it), one forgotten meanwhile is not; a look
    that raised is tried again after RETRY_AFTER_ERROR_SECONDS."""

    def __init__(self, look: LookHandler) -> None:
        self.look = look
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._looking: set[int] = set()
        self._armed_while_looking: set[int] = set()
        self._forgotten_while_looking: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._timers)

    def arm(self, key: int, when_ns: int) -> None:
        """Looks at `key` at `when_ns` (monotonic ns; now if past), instead of any time set."""
        if key in self._looking:
            self._armed_while_looking.add(key)
            self._forgotten_while_looking.discard(key)
            return
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_at(max(when_ns / 1e9, loop.time()), self._fire, key)

    def forget(self, key: int) -> None:
        """No more looks at `key` (a look in flight finishes, and arms nothing)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._armed_while_looking.discard(key)
        if key in self._looking:
            self._forgotten_while_looking.add(key)

    def _fire(self, key: int) -> None:
        self._timers.pop(key, None)
        if key in self._looking:
            return
        self._looking.add(key)
        task = asyncio.get_running_loop().create_task(self._look(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _look(self, key: int) -> None:
        next_ns: int | None = None
        try:
            next_ns = await self.look(key)
        except Exception:
            log.exception("looking at socket %x failed; trying again", key)
            next_ns = time.monotonic_ns() + int(RETRY_AFTER_ERROR_SECONDS * 1e9)
        finally:
            self._looking.discard(key)
        if key in self._forgotten_while_looking:
            self._forgotten_while_looking.discard(key)
            return
        if key in self._armed_while_looking:
            self._armed_while_looking.discard(key)
            next_ns = time.monotonic_ns()
        if next_ns is not None:
            self.arm(key, next_ns)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
