"""kvwatch's ASGI middleware for vLLM's API server: kvwatch's generic middleware (streams
announced to the agent, cancel, detach: kvwatch.hook.asgi) plus the agent's pause, park and
release of one stream, carried to kvwatch's scheduler in the EngineCore process.

    vllm serve MODEL --middleware kvwatch_vllm.middleware.Middleware \\
        --scheduler-cls kvwatch_vllm.scheduler.KvwatchAsyncScheduler

Pure ASGI, like its base (a BaseHTTPMiddleware breaks vLLM's disconnect detection, vLLM
issue 10087). Settings from the environment, as for the base: KVWATCH_ENGINE_SOCKET and the
others in docs/engines.md, plus KVWATCH_VLLM_COMMAND_TIMEOUT (seconds an EngineCore call may
take, default 4) and KVWATCH_VLLM_CONTROL_SOCKET (kvwatch_vllm.control; off by default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections import Counter
from typing import Any

from kvwatch.hook.asgi import ASGIApp, EngineHandlers
from kvwatch.hook.asgi import Middleware as AsgiMiddleware
from kvwatch.hook.asgi_stream import Receive, Scope, Send, header
from kvwatch.hookwire.types import CommandOutcome
from kvwatch_vllm.commands import EngineCommands, EngineUnreachableError
from kvwatch_vllm.control import CONTROL_SOCKET_ENV, ControlServer
from kvwatch_vllm.dispatch import Dispatch
from kvwatch_vllm.outcome import PARK, PARKED, PAUSE, RESUME

COMMAND_TIMEOUT_ENV = "KVWATCH_VLLM_COMMAND_TIMEOUT"
DEFAULT_COMMAND_TIMEOUT_SECONDS = 4.0  # under the hook's 5 s command timeout
ENGINE_NAME = "vllm"

_log = logging.getLogger("kvwatch_vllm")


class Middleware(AsgiMiddleware):  # type: ignore[misc]  # kvwatch-hook ships no py.typed
    """The generic middleware, given vLLM's pause, park and release as its engine handlers
    (`dispatch`, one `Dispatch` per process: kvwatch.hook.asgi.EngineHandlers), so its hello
    says "vllm" and offers pause and park, with vLLM's real KV geometry when the app's config
    can be read.

    Invariant: `dispatch` answers for any id; a stream is "live" from its announcement (its
    first token) to its close, and its vLLM requests are found by the id it was announced
    under (kvwatch_vllm.ids)."""

    def __init__(self, app: ASGIApp, **kwargs: Any) -> None:
        self._command_timeout_seconds = float(
            os.environ.get(COMMAND_TIMEOUT_ENV, DEFAULT_COMMAND_TIMEOUT_SECONDS)
        )
        self._header_ids: Counter[str] = Counter()
        self._engine: EngineCommands | None = None
        self._engine_lock = threading.Lock()
        self.dispatch = Dispatch(lambda: self._engine, self._announced_from_header)
        self.control: ControlServer | None = None
        handlers = EngineHandlers(
            pause=self.dispatch.pause,
            release=self.dispatch.resume,
            park=self.dispatch.park,
            engine=ENGINE_NAME,
        )
        super().__init__(app, engine_handlers=handlers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await super().__call__(scope, receive, send)
            return
        self._know_engine(scope)
        header_id = header(scope, b"x-request-id")
        if header_id is not None:
            self._header_ids[header_id] += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            if header_id is not None:
                self._header_ids[header_id] -= 1
                if self._header_ids[header_id] <= 0:
                    del self._header_ids[header_id]

    def _cancel(self, request_id: str, reason: str) -> CommandOutcome:
        """The base's cancel (the app's disconnect path, where vLLM aborts the request). A
        parked request's KV went back to vLLM's pool at its park, so its cancel frees nothing
        more (docs/protocol.md, "Park and resume"): not the base's estimate."""
        parked = self._parked(request_id)
        outcome: CommandOutcome = super()._cancel(request_id, reason)
        if parked and outcome.status == "cancelled":
            detail = "parked: its park had freed its KV"
            return dataclasses.replace(outcome, freed_blocks=0, freed_bytes=0, detail=detail)
        return outcome

    def _parked(self, stream_id: str) -> bool:
        """Whether vLLM holds the live stream's requests parked (False when unknown)."""
        engine, from_header = self._engine, self._announced_from_header(stream_id)
        if engine is None or from_header is None:
            return False
        try:
            state = engine.kv_state(stream_id, from_header=from_header)
        except EngineUnreachableError:
            return False
        return PARKED in [state["held"].get(engine_id) for engine_id in state["engine_ids"]]

    def _announced_from_header(self, stream_id: str) -> bool | None:
        """Whether the live stream `stream_id` was announced under its X-Request-Id (the base
        middleware prefers it to the chunk id), or None when no such stream is live."""
        if stream_id not in self._streams:
            return None
        return stream_id in self._header_ids

    def _know_engine(self, scope: Scope) -> None:
        """The engine client and the event loop, taken from the first request's app."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = self._make_engine(scope)

    def _make_engine(self, scope: Scope) -> EngineCommands | None:
        app = scope.get("app")
        client = getattr(getattr(app, "state", None), "engine_client", None)
        if client is None:
            _log.warning("kvwatch: no vLLM engine client on the app; pause/park fail")
            return None
        engine = EngineCommands(client, asyncio.get_running_loop(), self._command_timeout_seconds)
        path = os.environ.get(CONTROL_SOCKET_ENV)
        if path:
            self.control = ControlServer(path, self._control_handlers())
            self.control.start()
        return engine

    def _control_handlers(self) -> dict[str, Any]:
        def outcome(command: str) -> Any:
            def run(stream_id: str) -> dict[str, Any]:
                return dataclasses.asdict(self.dispatch.run(command, stream_id))

            return run

        def kv_state(stream_id: str) -> dict[str, Any]:
            engine, from_header = self._engine, self._announced_from_header(stream_id)
            if engine is None:
                return {"error": "the vLLM engine client is not known yet"}
            return engine.kv_state(stream_id, from_header=bool(from_header))

        return {
            PAUSE: outcome(PAUSE),
            PARK: outcome(PARK),
            RESUME: outcome(RESUME),
            "kv_state": kv_state,
        }

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        super().close()
