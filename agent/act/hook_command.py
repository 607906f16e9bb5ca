"""What the actions that are one command over the engine hook share (cancel, park, detach):
the command goes to the engine that announced the stream, its outcome is counted by action,
reason and status, and its result says the status, what the command did, and why not."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.tally import ActionTally
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookwire.types import CancelOutcome
from kvwatch.streams.view import StreamView

COMMAND_TIMEOUT_SECONDS = 2.0


class HookCommand(ABC):
    """Base of the hook actions: a subclass names itself, sends its command (`send`) and
    says what its outcome did (`took_effect`: tallies, and the result's fields)."""

    name = ""

    def __init__(self, hooks: HookServer, tally: ActionTally) -> None:
        self.hooks = hooks
        self.tally = tally

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        engine = view.engine
        assert engine is not None, f"{self.name} needs an engine-announced stream"
        outcome = await self.send(engine.request_id, attempt.reason, attempt.evidence)
        self.tally.outcomes[self.name, attempt.reason, outcome.status] += 1
        done = self.took_effect(engine, attempt, outcome)
        return {"status": outcome.status, **done, "detail": outcome.detail}

    @abstractmethod
    async def send(self, request_id: str, reason: str, evidence: dict[str, Any]) -> CancelOutcome:
        """The command to the engine, and its outcome."""

    @abstractmethod
    def took_effect(
        self, engine: EngineStream, attempt: Unfinished, outcome: CancelOutcome
    ) -> dict[str, Any]:
        """Tallies what the outcome did; returns the result's fields beyond status and detail."""
