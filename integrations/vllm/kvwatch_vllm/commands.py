"""The API server's end of the command path: runs a pause, park or resume of one stream's
vLLM requests in the EngineCore process, from any thread (the engine hook's command workers).

    hook worker thread ──run_coroutine_threadsafe──▶ API server's event loop
        ids: X-Request-Id → vLLM internal ids (output processor, kvwatch_vllm.ids)
        engine_core.call_utility_async("kvwatch_hold", command, ids)
            ──ZMQ──▶ EngineCore busy loop, between steps ──▶ scheduler.<command>_request(id)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from kvwatch_vllm.ids import engine_request_ids
from kvwatch_vllm.outcome import HoldResult

# The engine-core utilities kvwatch_vllm.engine_utility adds (this module imports no vLLM).
HOLD_UTILITY = "kvwatch_hold"
KV_STATE_UTILITY = "kvwatch_kv_state"


class EngineUnreachableError(RuntimeError):
    """The EngineCore did not answer (in time, or at all)."""


class EngineCommands:
    """Calls kvwatch's engine-core utilities through vLLM's engine client (`AsyncLLM`), on the
    API server's event loop, from other threads; every call waits at most `timeout_seconds`."""

    def __init__(
        self, engine_client: Any, loop: asyncio.AbstractEventLoop, timeout_seconds: float
    ) -> None:
        self._client = engine_client
        self._loop = loop
        self._timeout_seconds = timeout_seconds

    def hold(self, command: str, announced: str, *, from_header: bool) -> list[HoldResult]:
        """Runs `command` on every vLLM request behind the stream; [] when vLLM has none."""
        results = self._call(self._hold(command, announced, from_header))
        assert isinstance(results, list)
        return results

    def kv_state(self, announced: str, *, from_header: bool) -> dict[str, Any]:
        """The engine's free blocks, held requests and the stream's requests' block counts."""
        state = self._call(self._kv_state(announced, from_header))
        assert isinstance(state, dict)
        return state

    def engine_ids(self, announced: str, *, from_header: bool) -> list[str]:
        """vLLM's internal ids of the stream's requests (read on the event loop)."""
        ids = self._call(self._engine_ids(announced, from_header))
        assert isinstance(ids, list)
        return ids

    async def _engine_ids(self, announced: str, from_header: bool) -> list[str]:
        table = self._client.output_processor.external_req_ids
        return engine_request_ids(table, announced, from_header=from_header)

    async def _hold(self, command: str, announced: str, from_header: bool) -> list[HoldResult]:
        ids = await self._engine_ids(announced, from_header)
        if not ids:
            return []
        wire = await self._client.engine_core.call_utility_async(HOLD_UTILITY, command, ids)
        return [HoldResult.from_wire(item) for item in wire]

    async def _kv_state(self, announced: str, from_header: bool) -> dict[str, Any]:
        ids = await self._engine_ids(announced, from_header)
        state = await self._client.engine_core.call_utility_async(KV_STATE_UTILITY, ids)
        return {**state, "engine_ids": ids}

    def _call(self, coroutine: Any) -> object:
        if self._loop.is_closed():
            coroutine.close()
            raise EngineUnreachableError("the API server's event loop is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(self._timeout_seconds)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise EngineUnreachableError(
                f"the EngineCore did not answer within {self._timeout_seconds:g} s"
            ) from exc
