"""Runs the engine's handlers for the agent's commands (cancel, park, detach) off the hook's
I/O thread, each call with a deadline."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import Answer, Command, plural
from kvwatch.hookwire.types import CommandHandler, CommandOutcome

MAX_COMMANDS_IN_FLIGHT = 32
MAX_DETAIL_CHARS = 1000

_log = logging.getLogger("kvwatch.hook")


@dataclass(frozen=True)
class _Pending:
    command: Command
    deadline: float


class CommandRunner:
    """Runs each command on its own daemon thread with the engine's handler for its type and
    turns the outcome into the command's answer (`cancelled`, `parked`, `detached`).

    Owned by the hook's I/O thread (`submit`, `poll`, `next_deadline`, `abandon`); handler
    threads only put their result on a thread-safe queue and wake the I/O thread. Counters
    are per command type: `cancels_received`, `detaches_received`, `park_timeouts` ...
    Invariant: every submitted command gets exactly one answer from `submit` or `poll` — the
    handler's outcome, or `failed` at its deadline — unless its session ends first (`abandon`);
    a result that arrives after its answer was given is discarded. A handler that never returns
    leaves its daemon thread behind: that is the engine's bug, and the hook stays responsive.
    At most MAX_COMMANDS_IN_FLIGHT run at once, whatever their type.
    """

    def __init__(
        self,
        handlers: dict[str, CommandHandler],
        timeout_seconds: float,
        counters: EventCounters,
        wake: Callable[[], None],
    ) -> None:
        self._handlers = handlers
        self._timeout_seconds = timeout_seconds
        self._counters = counters
        self._wake = wake
        self._results: queue.SimpleQueue[tuple[int, object]] = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}
        self._tickets = itertools.count()

    def submit(self, command: Command, now: float) -> Answer | None:
        """Starts the handler; returns an immediate `failed` answer when it cannot run (too
        many in flight, or the engine has no handler for the command: it never said it can)."""
        kind = command.TYPE
        self._counters.add(f"{plural(kind)}_received")
        handler = self._handlers.get(kind)
        if handler is None:
            return _failed(command, f"this engine cannot {kind} (no {kind} handler)")
        if len(self._pending) >= MAX_COMMANDS_IN_FLIGHT:
            self._counters.add(f"{plural(kind)}_refused_busy")
            detail = f"{MAX_COMMANDS_IN_FLIGHT} commands already in flight; retry"
            return _failed(command, detail)
        ticket = next(self._tickets)
        worker = threading.Thread(
            target=self._run,
            args=(ticket, command, handler),
            name=f"kvwatch-hook-{kind}",
            daemon=True,
        )
        try:
            worker.start()
        except RuntimeError as exc:
            return _failed(command, f"could not start a {kind} thread: {exc}")
        self._pending[ticket] = _Pending(command, now + self._timeout_seconds)
        return None

    def poll(self, now: float) -> list[Answer]:
        """Answers for finished handlers and for those past their deadline."""
        answers: list[Answer] = []
        while True:
            try:
                ticket, result = self._results.get_nowait()
            except queue.Empty:
                break
            pending = self._pending.pop(ticket, None)
            if pending is not None:
                answers.append(self._answer(pending.command, result))
        for ticket, pending in list(self._pending.items()):
            if now >= pending.deadline:
                del self._pending[ticket]
                kind = pending.command.TYPE
                self._counters.add(f"{kind}_timeouts")
                detail = f"{kind} handler did not finish within {self._timeout_seconds:g} s"
                _log.warning("%s of %s: %s", kind, pending.command.request_id, detail)
                answers.append(_failed(pending.command, detail))
        return answers

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._pending.values()), default=None)

    def abandon(self) -> None:
        """Forgets the commands in flight: their session ended, nobody waits for the answers."""
        for pending in self._pending.values():
            self._counters.add(f"{pending.command.TYPE}_answers_lost")
        self._pending.clear()

    def _run(self, ticket: int, command: Command, handler: CommandHandler) -> None:
        result: object
        try:
            result = handler(command.request_id, command.reason)
        except Exception as exc:  # the engine's handler is foreign code: report, never crash
            result = exc
        self._results.put((ticket, result))
        self._wake()

    def _answer(self, command: Command, result: object) -> Answer:
        kind = command.TYPE
        if isinstance(result, CommandOutcome):
            try:
                result = dataclasses.replace(
                    result, request_id=command.request_id, detail=result.detail[:MAX_DETAIL_CHARS]
                )
                return command.ANSWER.of(result, command.correlation_id)
            except (ProtocolError, TypeError) as exc:
                detail = f"{kind} handler returned an invalid outcome: {exc}"
        elif isinstance(result, Exception):
            detail = f"{kind} handler raised {type(result).__name__}: {result}"
        else:
            detail = f"{kind} handler returned {type(result).__name__}, not a CommandOutcome"
        self._counters.add(f"{kind}_handler_errors")
        _log.error("%s of %s failed: %s", kind, command.request_id, detail)
        return _failed(command, detail)


def _failed(command: Command, detail: str) -> Answer:
    return command.ANSWER(
        request_id=command.request_id,
        status="failed",
        freed_blocks=0,
        freed_bytes=0,
        correlation_id=command.correlation_id,
        detail=detail[:MAX_DETAIL_CHARS],
    )
