"""The `reset` action: the socket is destroyed with SOCK_DESTROY in its network namespace
(for engines without the hook: vLLM, TGI and Triton abort a request whose connection dies);
behind a proxy, the proxy's client socket."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvwatch.act.kernel import SocketWorker
from kvwatch.act.tally import ActionTally
from kvwatch.errors import KvwatchError
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.streams.episodes import Unfinished
from kvwatch.streams.view import StreamView

# After a reset, how long the agent waits for the engine to close the request the connection
# carried (a client disconnect: the engine aborts it and frees its KV), and how often it looks.
RESET_FOLLOW_SECONDS = 5.0
RESET_FOLLOW_POLL_SECONDS = 0.02


class Reset:
    """After a reset of a socket whose request is known and was not cancelled by this
    decision, follows the engine's close of that request and reports its KV as freed: the
    engine aborts a request whose client is gone (directly, or through the proxy closing
    its upstream)."""

    name = "reset"

    def __init__(self, worker: SocketWorker, hooks: HookServer, tally: ActionTally) -> None:
        self.worker = worker
        self.hooks = hooks
        self.tally = tally

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        try:
            status, detail = await self.worker.destroy(view.sample, view.socket_pid), ""
        except KvwatchError as exc:
            status, detail = "failed", str(exc)
        self.tally.outcomes[self.name, attempt.reason, status] += 1
        result: dict[str, Any] = {"status": status, "detail": detail}
        if status == "reset" and not attempt.cancelled and view.engine is not None:
            result.update(await self._follow(view.engine))
        return result

    async def _follow(self, engine: EngineStream) -> dict[str, Any]:
        deadline = time.monotonic() + RESET_FOLLOW_SECONDS
        while self.hooks.live(engine.request_id):
            if time.monotonic() > deadline:
                return {"request_closed": False, "freed_blocks": 0, "freed_bytes": 0}
            await asyncio.sleep(RESET_FOLLOW_POLL_SECONDS)
        self.tally.reclaimed(engine.kv_blocks, engine.kv_bytes)
        return {
            "request_closed": True,
            "freed_blocks": engine.kv_blocks,
            "freed_bytes": engine.kv_bytes,
        }
