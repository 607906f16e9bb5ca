"""The `park` action: the engine frees the request's KV now and keeps the request and its
connection, resuming it when the client reads again (docs/protocol.md, "Park and resume"),
over the engine hook. Chosen by kvwatch.policy.park, before any proof of a stall."""

from __future__ import annotations

from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.hook_command import COMMAND_TIMEOUT_SECONDS, HookCommand
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookwire.types import CancelOutcome


class Park(HookCommand):
    """Parks go to the engine that announced the stream, on the engine's own socket."""

    name = "park"

    async def send(self, request_id: str, reason: str, evidence: dict[str, Any]) -> CancelOutcome:
        return await self.hooks.park(request_id, reason, evidence, COMMAND_TIMEOUT_SECONDS)

    def took_effect(
        self, engine: EngineStream, attempt: Unfinished, outcome: CancelOutcome
    ) -> dict[str, Any]:
        if outcome.status == "parked":
            self.tally.parked(outcome.freed_blocks, outcome.freed_bytes)
        return {"freed_blocks": outcome.freed_blocks, "freed_bytes": outcome.freed_bytes}
