"""The `cancel` action: the engine stops the request, waits for device work on its blocks,
frees them and answers with what it freed (two-phase), over the engine hook."""

from __future__ import annotations

import time
from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.hook_command import COMMAND_TIMEOUT_SECONDS, HookCommand
from kvwatch.act.tally import ActionTally
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookwire.types import CancelOutcome
from kvwatch.streams.relay import Cancels


class Cancel(HookCommand):
    """Cancels go to the engine that announced the stream; `cancels` remembers each request
    cancelled, by engine socket, for the relay join (its client socket at a proxy is reset)."""

    name = "cancel"

    def __init__(self, hooks: HookServer, tally: ActionTally, cancels: Cancels) -> None:
        super().__init__(hooks, tally)
        self.cancels = cancels

    async def send(self, request_id: str, reason: str, evidence: dict[str, Any]) -> CancelOutcome:
        return await self.hooks.cancel(request_id, reason, evidence, COMMAND_TIMEOUT_SECONDS)

    def took_effect(
        self, engine: EngineStream, attempt: Unfinished, outcome: CancelOutcome
    ) -> dict[str, Any]:
        attempt.cancelled = outcome.status == "cancelled"
        if attempt.cancelled:
            self.tally.reclaimed(outcome.freed_blocks, outcome.freed_bytes)
            self.cancels.add(engine, time.monotonic_ns())
        return {"freed_blocks": outcome.freed_blocks, "freed_bytes": outcome.freed_bytes}
