"""Holds: the requests the agent paused or parked, each with its lease, released by the hook
itself when the lease runs out or the agent's connection ends (docs/protocol.md, "Pause and
release"). An engine must never depend on the agent: a hold nobody renews ends."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.types import CommandHandler, CommandOutcome

# A pause or park whose command names no lease (`lease_ms` 0) holds this long unrenewed.
DEFAULT_LEASE_SECONDS = 10.0

_log = logging.getLogger("kvwatch.hook")


class HoldKeeper:
    """The leases of held requests, and the releases the hook starts on its own.

    The hook's I/O thread calls `hold`, `drop`, `expire`, `release_all` and `next_expiry`;
    each release it starts runs the engine's release handler on a daemon thread of its own
    (the handler may block until its step boundary) and then calls `on_released` with the
    request id and the outcome. Counters: `lease_expiries` (a lease ran out), and
    `releases_without_agent` (held when the agent's connection ended).
    Invariant: a request is held here from the answer that held it (paused or parked) until
    a release answer, its stream's close, or the hook's own release."""

    def __init__(
        self,
        release: CommandHandler | None,
        counters: EventCounters,
        on_released: Callable[[str, CommandOutcome | None], None],
    ) -> None:
        self._release = release
        self._counters = counters
        self._on_released = on_released
        self._until: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def hold(self, request_id: str, lease_ms: int, now: float) -> None:
        """The request was paused or parked (or its hold renewed): held until the lease ends."""
        lease_seconds = lease_ms / 1000 if lease_ms else DEFAULT_LEASE_SECONDS
        self._until[request_id] = now + lease_seconds

    def drop(self, request_id: str) -> None:
        """The request is no longer held (released, or its stream closed)."""
        self._until.pop(request_id, None)

    def next_expiry(self) -> float | None:
        return min(self._until.values(), default=None)

    def expire(self, now: float) -> None:
        """Releases every request whose lease ran out."""
        for request_id, until in list(self._until.items()):
            if until <= now:
                self._counters.add("lease_expiries")
                self._start_release(request_id, "lease_expired")

    def release_all(self) -> None:
        """The agent's connection ended: every held request is released."""
        for request_id in list(self._until):
            self._counters.add("releases_without_agent")
            self._start_release(request_id, "agent_disconnected")

    def _start_release(self, request_id: str, reason: str) -> None:
        del self._until[request_id]
        handler = self._release
        if handler is None:  # an engine that parks but cannot pause resumes on its own
            return
        _log.info("releasing %s: %s", request_id, reason)
        worker = threading.Thread(
            target=self._run, args=(handler, request_id, reason), name="kvwatch-hook-release"
        )
        worker.daemon = True
        worker.start()

    def _run(self, handler: CommandHandler, request_id: str, reason: str) -> None:
        outcome: CommandOutcome | None
        try:
            outcome = handler(request_id, reason)
        except Exception:  # the engine's handler is foreign code: report, never crash
            _log.exception("release of %s failed", request_id)
            outcome = None
        self._on_released(request_id, outcome)
