"""The `detach` action: the engine's ASGI middleware sends the rest of the response into a
bounded host buffer, so the generation runs to its end and frees its KV (or the generation
lock) then, not when the client reads (docs/protocol.md, "Detach"). For engines that can
detach but not park; chosen by kvwatch.policy.park, before any proof of a stall."""

from __future__ import annotations

from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.hook_command import COMMAND_TIMEOUT_SECONDS, HookCommand
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookwire.types import CancelOutcome, DetachOutcome


class Detach(HookCommand):
    """Detaches go to the engine that announced the stream, on the engine's own socket."""

    name = "detach"

    async def send(self, request_id: str, reason: str, evidence: dict[str, Any]) -> CancelOutcome:
        return await self.hooks.detach(request_id, reason, evidence, COMMAND_TIMEOUT_SECONDS)

    def took_effect(
        self, engine: EngineStream, attempt: Unfinished, outcome: CancelOutcome
    ) -> dict[str, Any]:
        assert isinstance(outcome, DetachOutcome), "a detach's outcome says what it buffered"
        return {"buffered_bytes": outcome.buffered_bytes}
