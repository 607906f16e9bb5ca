"""The `detach` action: the engine's ASGI middleware sends the rest of the response into a
bounded host buffer, so the generation runs to its end and frees its KV (or the generation
lock) then, not when the client reads (docs/protocol.md, "Detach"). For engines that can
detach but not park; chosen by kvwatch.policy.park, before any proof of a stall."""

from __future__ import annotations

from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.tally import ActionTally
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.streams.view import StreamView

DETACH_TIMEOUT_SECONDS = 2.0


class Detach:
    """Detaches go to the engine that announced the stream, on the engine's own socket."""

    name = "detach"

    def __init__(self, hooks: HookServer, tally: ActionTally) -> None:
        self.hooks = hooks
        self.tally = tally

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        engine = view.engine
        assert engine is not None, "detach needs an engine-announced stream"
        outcome = await self.hooks.detach(
            engine.request_id,
            attempt.reason,
            attempt.evidence,
            timeout_seconds=DETACH_TIMEOUT_SECONDS,
        )
        self.tally.outcomes[self.name, attempt.reason, outcome.status] += 1
        return {
            "status": outcome.status,
            "buffered_bytes": outcome.buffered_bytes,
            "detail": outcome.detail,
        }
