"""The `park` action: the engine frees the request's KV now and keeps the request and its
connection, resuming it when the client reads again (docs/protocol.md, "Park and resume"),
over the engine hook. Chosen by kvwatch.policy.park, before any proof of a stall."""

from __future__ import annotations

from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.tally import ActionTally
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.streams.view import StreamView

PARK_TIMEOUT_SECONDS = 2.0


class Park:
    """Parks go to the engine that announced the stream, on the engine's own socket."""

    name = "park"

    def __init__(self, hooks: HookServer, tally: ActionTally) -> None:
        self.hooks = hooks
        self.tally = tally

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        engine = view.engine
        assert engine is not None, "park needs an engine-announced stream"
        outcome = await self.hooks.park(
            engine.request_id,
            attempt.reason,
            attempt.evidence,
            timeout_seconds=PARK_TIMEOUT_SECONDS,
        )
        self.tally.outcomes[self.name, attempt.reason, outcome.status] += 1
        if outcome.status == "parked":
            self.tally.parked(outcome.freed_blocks, outcome.freed_bytes)
        return {
            "status": outcome.status,
            "freed_blocks": outcome.freed_blocks,
            "freed_bytes": outcome.freed_bytes,
            "detail": outcome.detail,
        }
