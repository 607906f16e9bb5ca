"""Runs the engine's cancel handler off the hook's I/O thread, each call with a deadline."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import Cancel, Cancelled
from kvwatch.hookwire.types import CancelHandler, CancelOutcome

MAX_CANCELS_IN_FLIGHT = 32
MAX_DETAIL_CHARS = 1000

_log = logging.getLogger("kvwatch.hook")


@dataclass(frozen=True)
class _Pending:
    cancel: Cancel
    deadline: float


class CancelRunner:
    """Runs each cancel on its own daemon thread and turns the outcome into a `cancelled` answer.

    Owned by the hook's I/O thread (`submit`, `poll`, `next_deadline`, `abandon`); handler
    threads only put their result on a thread-safe queue and wake the I/O thread.
    Invariant: every submitted cancel gets exactly one answer from `submit` or `poll` — the
    handler's outcome, or `failed` at its deadline — unless its session ends first (`abandon`);
    a result that arrives after its answer was given is discarded. A handler that never returns
    leaves its daemon thread behind: that is the engine's bug, and the hook stays responsive.
    """

    def __init__(
        self,
        handler: CancelHandler,
        timeout_seconds: float,
        counters: EventCounters,
        wake: Callable[[], None],
    ) -> None:
        self._handler = handler
        self._timeout_seconds = timeout_seconds
        self._counters = counters
        self._wake = wake
        self._results: queue.SimpleQueue[tuple[int, object]] = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}
        self._tickets = itertools.count()

    def submit(self, cancel: Cancel, now: float) -> Cancelled | None:
        """Starts the handler; returns an immediate `failed` answer when it cannot run."""
        self._counters.add("cancels_received")
        if len(self._pending) >= MAX_CANCELS_IN_FLIGHT:
            self._counters.add("cancels_refused_busy")
            return _failed(cancel, f"{MAX_CANCELS_IN_FLIGHT} cancels already in flight; retry")
        ticket = next(self._tickets)
        worker = threading.Thread(
            target=self._run, args=(ticket, cancel), name="kvwatch-hook-cancel", daemon=True
        )
        try:
            worker.start()
        except RuntimeError as exc:
            return _failed(cancel, f"could not start a cancel thread: {exc}")
        self._pending[ticket] = _Pending(cancel, now + self._timeout_seconds)
        return None

    def poll(self, now: float) -> list[Cancelled]:
        """Answers for finished handlers and for those past their deadline."""
        answers: list[Cancelled] = []
        while True:
            try:
                ticket, result = self._results.get_nowait()
            except queue.Empty:
                break
            pending = self._pending.pop(ticket, None)
            if pending is not None:
                answers.append(self._answer(pending.cancel, result))
        for ticket, pending in list(self._pending.items()):
            if now >= pending.deadline:
                del self._pending[ticket]
                self._counters.add("cancel_timeouts")
                detail = f"cancel handler did not finish within {self._timeout_seconds:g} s"
                _log.warning("cancel of %s: %s", pending.cancel.request_id, detail)
                answers.append(_failed(pending.cancel, detail))
        return answers

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._pending.values()), default=None)

    def abandon(self) -> None:
        """Forgets the cancels in flight: their session ended, nobody waits for the answers."""
        self._counters.add("cancel_answers_lost", len(self._pending))
        self._pending.clear()

    def _run(self, ticket: int, cancel: Cancel) -> None:
        result: object
        try:
            result = self._handler(cancel.request_id, cancel.reason)
        except Exception as exc:  # the engine's handler is foreign code: report, never crash
            result = exc
        self._results.put((ticket, result))
        self._wake()

    def _answer(self, cancel: Cancel, result: object) -> Cancelled:
        if isinstance(result, CancelOutcome):
            try:
                return Cancelled(
                    request_id=cancel.request_id,
                    status=result.status,
                    freed_blocks=result.freed_blocks,
                    freed_bytes=result.freed_bytes,
                    correlation_id=cancel.correlation_id,
                    detail=result.detail[:MAX_DETAIL_CHARS],
                )
            except (ProtocolError, TypeError) as exc:
                detail = f"cancel handler returned an invalid outcome: {exc}"
        elif isinstance(result, Exception):
            detail = f"cancel handler raised {type(result).__name__}: {result}"
        else:
            detail = f"cancel handler returned {type(result).__name__}, not a CancelOutcome"
        self._counters.add("cancel_handler_errors")
        _log.error("cancel of %s failed: %s", cancel.request_id, detail)
        return _failed(cancel, detail)


def _failed(cancel: Cancel, detail: str) -> Cancelled:
    return Cancelled(
        request_id=cancel.request_id,
        status="failed",
        freed_blocks=0,
        freed_bytes=0,
        correlation_id=cancel.correlation_id,
        detail=detail[:MAX_DETAIL_CHARS],
    )
