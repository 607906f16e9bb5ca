"""Waiting in tests: look at a condition until it holds, or fail saying what never happened.

A fixed sleep is either longer than needed or, on a loaded machine, too short; these helpers
wait as long as the condition takes, up to a timeout, and a timeout names what was awaited
(`what`: a phrase, or a function that describes the state at the moment of failure).

A test that means to let time pass (nothing must happen during a window, a clock must
advance, a soak, a client pacing its reads) sleeps instead, and its comment says why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Description = str | Callable[[], str]
POLL_SECONDS = 0.02


def _timed_out(timeout_seconds: float, what: Description) -> AssertionError:
    described = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout_seconds:g} s waiting for {described}")


def wait_for(
    produce: Callable[[], T | None],
    timeout_seconds: float,
    what: Description = "the condition",
    poll_seconds: float = POLL_SECONDS,
) -> T:
    """Calls `produce` every `poll_seconds` until it returns something truthy, and returns
    that; an AssertionError naming `what` after `timeout_seconds`."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = produce()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout_seconds, what)
        time.sleep(poll_seconds)


def wait_until(
    condition: Callable[[], object],
    timeout_seconds: float,
    what: Description = "the condition",
    poll_seconds: float = POLL_SECONDS,
) -> None:
    """Until `condition()` is truthy (checked every `poll_seconds`); an AssertionError naming
    `what` after `timeout_seconds`."""
    wait_for(lambda: bool(condition()) or None, timeout_seconds, what, poll_seconds)


async def wait_until_async(
    condition: Callable[[], object],
    timeout_seconds: float,
    what: Description = "the condition",
    poll_seconds: float = POLL_SECONDS,
) -> None:
    """`wait_until` inside an event loop: the loop runs on between the looks."""
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        if time.monotonic() > deadline:
            raise _timed_out(timeout_seconds, what)
        await asyncio.sleep(poll_seconds)
