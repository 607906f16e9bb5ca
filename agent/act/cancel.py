"""The `cancel` action: the engine stops the request, waits for device work on its blocks,
frees them and answers with what it freed (two-phase), over the engine hook."""

from __future__ import annotations

import time
from typing import Any

from kvwatch.act.episodes import Unfinished
from kvwatch.act.tally import ActionTally
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.streams.relay import Cancels
from kvwatch.streams.view import StreamView

CANCEL_TIMEOUT_SECONDS = 2.0


class Cancel:
    """Cancels go to the engine that announced the stream; `cancels` remembers each request
    cancelled, by engine socket, for the relay join (its client socket at a proxy is reset)."""

    name = "cancel"

    def __init__(self, hooks: HookServer, tally: ActionTally, cancels: Cancels) -> None:
        self.hooks = hooks
        self.tally = tally
        self.cancels = cancels

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        engine = view.engine
        assert engine is not None, "cancel needs an engine-announced stream"
        outcome = await self.hooks.cancel(
            engine.request_id,
            attempt.reason,
            attempt.evidence,
            timeout_seconds=CANCEL_TIMEOUT_SECONDS,
        )
        self.tally.outcomes[self.name, attempt.reason, outcome.status] += 1
        attempt.cancelled = outcome.status == "cancelled"
        if attempt.cancelled:
            self.tally.reclaimed(outcome.freed_blocks, outcome.freed_bytes)
            self.cancels.add(engine, time.monotonic_ns())
        return {
            "status": outcome.status,
            "freed_blocks": outcome.freed_blocks,
            "freed_bytes": outcome.freed_bytes,
            "detail": outcome.detail,
        }
