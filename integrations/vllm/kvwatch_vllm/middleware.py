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
import inspect
import logging
import os
import threading
from collections import Counter
from typing import Any

from kvwatch.hook.asgi import ASGIApp
from kvwatch.hook.asgi import Middleware as AsgiMiddleware
from kvwatch.hook.asgi_kv import KvGeometry, detect
from kvwatch.hook.asgi_stream import Receive, Scope, Send, header
from kvwatch.hook.engine_hook import EngineHook
from kvwatch.hookwire.protocol import EngineInfo
from kvwatch_vllm.commands import EngineCommands
from kvwatch_vllm.control import CONTROL_SOCKET_ENV, ControlServer
from kvwatch_vllm.dispatch import Dispatch
from kvwatch_vllm.outcome import PARK, PAUSE, RESUME

COMMAND_TIMEOUT_ENV = "KVWATCH_VLLM_COMMAND_TIMEOUT"
DEFAULT_COMMAND_TIMEOUT_SECONDS = 4.0  # under the hook's 5 s command timeout
ENGINE_NAME = "vllm"

_log = logging.getLogger("kvwatch_vllm")


class Middleware(AsgiMiddleware):  # type: ignore[misc]  # kvwatch-hook ships no py.typed
    """The generic middleware, whose engine hook also runs pause, park and release through
    `dispatch` (one `Dispatch` per process), and whose hello says "vllm" with vLLM's real
    KV geometry when the app's config can be read.

    Invariant: `dispatch` answers for any id; a stream is "live" from its announcement (its
    first token) to its close, and its vLLM requests are found by the id it was announced
    under (kvwatch_vllm.ids)."""

    hook: EngineHook | None
    _geometry: KvGeometry | None

    def __init__(self, app: ASGIApp, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._command_timeout_seconds = float(
            os.environ.get(COMMAND_TIMEOUT_ENV, DEFAULT_COMMAND_TIMEOUT_SECONDS)
        )
        self._header_ids: Counter[str] = Counter()
        self._engine: EngineCommands | None = None
        self._engine_lock = threading.Lock()
        self.dispatch = Dispatch(lambda: self._engine, self._announced_from_header)
        self.control: ControlServer | None = None

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

    def _start(self, scope: Scope) -> tuple[EngineHook, KvGeometry]:
        """The base's, with kvwatch-vllm's handlers given to the hook (the base has no way to
        add handlers; docs/engines.md asks for one)."""
        with self._lock:
            hook: EngineHook | None = self.hook
            if hook is None or self._geometry is None:
                geometry = detect(scope.get("app", self.app), self._bytes_per_token)
                info = EngineInfo(
                    engine=ENGINE_NAME,
                    model=geometry.model,
                    pid=os.getpid(),
                    bytes_per_block=geometry.bytes_per_block,
                    device=geometry.device,
                    kv_blocks_total=0,
                )
                hook = EngineHook(
                    info,
                    self._cancel,
                    self._socket_path,
                    detach_handler=self._detach if self._egress.detach_bytes else None,
                    cancel_timeout_seconds=self._cancel_timeout_seconds,
                    reconnect_seconds=self._reconnect_seconds,
                    **self._hold_handlers(),
                )
                hook.start()
                self.hook, self._geometry = hook, geometry
                _log.info("kvwatch hook for vLLM (%s): pause, park, release", info.model)
            assert self._geometry is not None
            return hook, self._geometry

    def _hold_handlers(self) -> dict[str, Any]:
        """The handlers this hook version takes: park always; pause and release (the
        protocol's resume) once the hook has them."""
        accepted = inspect.signature(EngineHook.__init__).parameters
        wanted = {
            "park_handler": self.dispatch.park,
            "pause_handler": self.dispatch.pause,
            "release_handler": self.dispatch.resume,
        }
        return {name: handler for name, handler in wanted.items() if name in accepted}

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        super().close()

