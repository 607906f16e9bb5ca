"""The actions that are one command over the engine hook (kvwatch.hookwire.commands: cancel,
park, detach, pause, release): the command goes to the engine that announced the stream, its
outcome is counted by action, reason and status, and its result says the status, what the
command did, and why not. One row each: the action's name (its command's), the outcome's
fields its result carries, what its effect is tallied as when it took effect, and the lease
it asks for (a pause's, a park's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvwatch.act.tally import ActionTally
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookwire.commands import command_kind
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.streams.episodes import Unfinished
from kvwatch.streams.relay import Cancels
from kvwatch.streams.view import StreamView

COMMAND_TIMEOUT_SECONDS = 2.0
FREED = ("freed_blocks", "freed_bytes")
# What an action's effect does besides its outcome line: tallies, and the cancel's marks.
Effect = Callable[[EngineStream, Unfinished, CommandOutcome], None]


@dataclass(frozen=True)
class HookAction:
    """One hook command as an action: `fields` are the outcome's fields its result carries,
    `effect` runs when the outcome says the command took effect (its command's `effect`
    status)."""

    name: str
    fields: tuple[str, ...]
    effect: Effect | None
    hooks: HookServer
    tally: ActionTally
    lease_ms: int = 0

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        engine = view.engine
        assert engine is not None, f"{self.name} needs an engine-announced stream"
        outcome = await self.hooks.command(
            self.name,
            engine.request_id,
            attempt.reason,
            attempt.evidence,
            COMMAND_TIMEOUT_SECONDS,
            lease_ms=self.lease_ms,
        )
        self.tally.outcomes[self.name, attempt.reason, outcome.status] += 1
        if self.effect is not None and outcome.status == command_kind(self.name).effect:
            self.effect(engine, attempt, outcome)
        done = {name: getattr(outcome, name) for name in self.fields}
        return {"status": outcome.status, **done, "detail": outcome.detail}


def hook_actions(
    hooks: HookServer, tally: ActionTally, cancels: Cancels, lease_ms: int
) -> list[HookAction]:
    """The table: cancel (its KV reclaimed; `cancels` remembers the request, by engine socket,
    for the relay join: its client socket at a proxy is reset), park (its KV freed for now;
    held for `lease_ms` unless renewed), detach (nothing freed at once: what its buffer
    held), pause (held for `lease_ms` unless renewed) and release."""

    def cancelled(engine: EngineStream, attempt: Unfinished, outcome: CommandOutcome) -> None:
        attempt.cancelled = True
        tally.reclaimed(outcome.freed_blocks, outcome.freed_bytes)
        cancels.add(engine, time.monotonic_ns())

    def parked(engine: EngineStream, attempt: Unfinished, outcome: CommandOutcome) -> None:
        tally.parked(outcome.freed_blocks, outcome.freed_bytes)

    rows: tuple[tuple[str, tuple[str, ...], Effect | None, int], ...] = (
        ("cancel", FREED, cancelled, 0),
        ("park", FREED, parked, lease_ms),
        ("detach", ("buffered_bytes",), None, 0),
        ("pause", (), None, lease_ms),
        ("release", (), None, 0),
    )
    return [
        HookAction(name, fields, effect, hooks, tally, lease)
        for name, fields, effect, lease in rows
    ]
