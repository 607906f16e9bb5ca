"""The look timers (kvwatch.streams.look_timers): a look comes when it is armed for, not
before and not by polling; re-arming moves it; at most one look per socket at a time, and a
socket armed during its look is looked at again after it; one forgotten during its look is
not; a look that raised is tried again."""

from __future__ import annotations

import asyncio
import time

from kvwatch.streams.look_timers import RETRY_AFTER_ERROR_SECONDS, LookTimers
from tests.hookserver.conftest import run_async, wait_until

MS = 1_000_000


class Looks:
    """A look handler that records when it ran, may wait for `release`, answers `answers`
    in turn (an exception is raised), then None."""

    def __init__(self, *answers: int | Exception | None, release: asyncio.Event | None = None):
        self.answers = list(answers)
        self.release = release
        self.at: list[int] = []
        self.running = 0
        self.most_running = 0

    async def __call__(self, key: int) -> int | None:
        self.at.append(time.monotonic_ns())
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.release is not None:
                await self.release.wait()
            answer = self.answers.pop(0) if self.answers else None
            if isinstance(answer, Exception):
                raise answer
            return answer
        finally:
            self.running -= 1


def test_a_look_comes_when_armed_for_and_rearming_moves_it() -> None:
    looks = Looks()

    async def scenario() -> None:
        timers = LookTimers(looks)
        start = time.monotonic_ns()
        timers.arm(1, start + 400 * MS)
        timers.arm(1, start + 200 * MS)  # moved earlier: one look, at the new time
        await wait_until(lambda: bool(looks.at))
        await asyncio.sleep(0.3)  # deliberate: room for a second look at the old time
        assert len(looks.at) == 1 and start + 200 * MS <= looks.at[0] < start + 350 * MS
        timers.close()

    run_async(scenario())


def test_the_answer_arms_the_next_look_and_none_ends_the_following() -> None:
    async def scenario() -> None:
        looks = Looks(time.monotonic_ns() + 100 * MS)
        timers = LookTimers(looks)
        timers.arm(1, time.monotonic_ns())
        await wait_until(lambda: len(looks.at) == 2)
        assert looks.at[1] - looks.at[0] >= 90 * MS
        await asyncio.sleep(0.2)  # deliberate: the second look answered None
        assert len(looks.at) == 2 and len(timers) == 0
        timers.close()

    run_async(scenario())


def test_one_look_at_a_time_and_an_arm_during_it_looks_again_after() -> None:
    release = asyncio.Event()
    looks = Looks(release=release)

    async def scenario() -> None:
        timers = LookTimers(looks)
        timers.arm(1, time.monotonic_ns())
        await wait_until(lambda: looks.running == 1)
        for _ in range(5):
            timers.arm(1, time.monotonic_ns())
        await asyncio.sleep(0.05)  # deliberate: no second look may start meanwhile
        assert looks.most_running == 1 and len(looks.at) == 1
        release.set()
        await wait_until(lambda: len(looks.at) == 2)
        await asyncio.sleep(0.1)  # deliberate: the five arms made one look, not five
        assert len(looks.at) == 2
        timers.close()

    run_async(scenario())


def test_a_socket_forgotten_during_its_look_is_not_looked_at_again() -> None:
    release = asyncio.Event()

    async def scenario() -> None:
        looks = Looks(time.monotonic_ns(), release=release)
        timers = LookTimers(looks)
        timers.arm(1, time.monotonic_ns())
        await wait_until(lambda: looks.running == 1)
        timers.forget(1)
        release.set()
        await wait_until(lambda: looks.running == 0)
        await asyncio.sleep(0.1)  # deliberate: the answer would have looked again at once
        assert len(looks.at) == 1 and len(timers) == 0
        timers.close()

    run_async(scenario())


def test_a_look_that_raised_is_tried_again() -> None:
    looks = Looks(RuntimeError("the first look fails"))

    async def scenario() -> None:
        timers = LookTimers(looks)
        timers.arm(1, time.monotonic_ns())
        await wait_until(lambda: len(looks.at) == 2, timeout_seconds=3)
        assert looks.at[1] - looks.at[0] >= RETRY_AFTER_ERROR_SECONDS * 0.9 * 1e9
        timers.close()

    run_async(scenario())
