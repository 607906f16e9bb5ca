"""The kvwatch engine hook as pure ASGI middleware, for engines whose HTTP layer is ASGI.

    vllm serve MODEL --middleware kvwatch.hook.asgi.Middleware
    KVWATCH_WRAP_FACTORY=llama_cpp.server.app:create_app MODEL=m.gguf \\
        uvicorn --factory kvwatch.hook.asgi:wrapped_factory

Each streaming (text/event-stream) response is announced to the kvwatch agent at its first
token (the first SSE event with data: comments and keep-alives are not tokens) with its request
id, the connection's real addresses and an estimated KV size; a `cancel` from the agent
becomes `http.disconnect` for the app (its own abort path frees the KV), then a TCP reset; a
`detach` sends the rest of that response through a bounded host buffer, so the app's
generator runs to its end whatever its client reads; a `pause` holds the app's next send
until a `release` (kvwatch.hook.asgi_pause). After its first token a response's body is
written coalesced (kvwatch.hook.asgi_coalesce). An engine that can hold a request in its own
scheduler gives the middleware its handlers (`EngineHandlers`): the hook then runs the
engine's pause, release and park instead of the HTTP-side pause (kvwatch_vllm does).
Settings come from keyword arguments or, for `--middleware` (which passes none), from the
environment: KVWATCH_ENGINE_SOCKET, KVWATCH_KV_BYTES_PER_TOKEN, KVWATCH_EGRESS_BUFFER_BYTES
(every response buffered; 0, the default, keeps egress coupled), KVWATCH_DETACH_BUFFER_BYTES
(a detached stream's buffer; 0 turns detach off), KVWATCH_EGRESS_TOTAL_BYTES (all buffers
together), KVWATCH_COALESCE_BYTES and KVWATCH_COALESCE_MS (0 in either writes each message
as it comes). Imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import itertools
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvwatch.errors import ConfigError
from kvwatch.hook.asgi_coalesce import DEFAULT_COALESCE_BYTES, DEFAULT_COALESCE_MS, Coalescing
from kvwatch.hook.asgi_conn import Connection, find_connection
from kvwatch.hook.asgi_egress import EgressBudget, EgressLimits
from kvwatch.hook.asgi_kv import KvGeometry, detect
from kvwatch.hook.asgi_stream import Message, Receive, RequestStream, Scope, Send, header
from kvwatch.hook.engine_hook import EngineHook
from kvwatch.hookwire.protocol import EngineInfo
from kvwatch.hookwire.types import CommandHandler, CommandOutcome

BYTES_PER_TOKEN_ENV = "KVWATCH_KV_BYTES_PER_TOKEN"
EGRESS_BUFFER_ENV = "KVWATCH_EGRESS_BUFFER_BYTES"
DETACH_BUFFER_ENV = "KVWATCH_DETACH_BUFFER_BYTES"
EGRESS_TOTAL_ENV = "KVWATCH_EGRESS_TOTAL_BYTES"
COALESCE_BYTES_ENV = "KVWATCH_COALESCE_BYTES"
COALESCE_MS_ENV = "KVWATCH_COALESCE_MS"
WRAP_FACTORY_ENV = "KVWATCH_WRAP_FACTORY"
DEFAULT_DETACH_BUFFER_BYTES = 16 * 1024 * 1024
DEFAULT_EGRESS_TOTAL_BYTES = 256 * 1024 * 1024
CANCEL_TIMEOUT_SECONDS = 5.0
# The hook answers `failed` at its own timeout; the middleware gives up a little earlier.
CANCEL_WAIT_MARGIN_SECONDS = 0.5
FINALIZER_TURNS = 4

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_log = logging.getLogger("kvwatch.hook.asgi")


@dataclass(frozen=True)
class EngineHandlers:
    """An engine's own hold commands, for an engine that can pause (and park) a request in its
    scheduler: the hook runs these instead of the middleware's HTTP-side pause and release.

    Each is an `EngineHook` command handler: called on a hook worker thread with the id the
    stream was announced under and the agent's reason, it answers a `CommandOutcome` with
    the protocol's statuses (docs/protocol.md, "Pause and release", "Park and resume"); the
    hook's own releases (a lease that ran out, the agent gone) come to `release` too. `pause`
    and `release` are the protocol's "pause" feature and come together; `park` (optional,
    the "park" feature) needs them, since a release is what brings a parked request back, and
    the pause of a parked request (the agent's lease renewal) must answer "paused". `engine`
    names the engine in the hello (None: the name the middleware detects). Cancel and detach
    stay the middleware's.
    """

    pause: CommandHandler
    release: CommandHandler
    park: CommandHandler | None = None
    engine: str | None = None


class Middleware:
    """Wraps an ASGI app; one engine hook (and agent connection) per process, started at the
    first HTTP request, when the engine's configuration can be read from the app.

    Invariants: the app sees every message it would see without kvwatch, except after a
    cancel (then `http.disconnect`); a missing, slow or misbehaving agent never delays a
    request (the hook never blocks); buffered egress (every response, `egress_buffer_bytes`
    each, or those the agent detached, `detach_buffer_bytes` each) holds at most
    `egress_total_bytes` over all streams (a single larger message excepted).

    `engine_handlers` (EngineHandlers) is the extension point for an engine that holds
    requests itself: a subclass passes its handlers to `__init__` (vLLM's `--middleware`
    builds the class with the app alone). Without them, a pause holds the app's next send.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        socket_path: str | None = None,
        bytes_per_token: int | None = None,
        egress_buffer_bytes: int | None = None,
        detach_buffer_bytes: int | None = None,
        egress_total_bytes: int | None = None,
        coalesce_bytes: int | None = None,
        coalesce_ms: int | None = None,
        cancel_timeout_seconds: float = CANCEL_TIMEOUT_SECONDS,
        reconnect_seconds: float = 1.0,
        engine_handlers: EngineHandlers | None = None,
    ) -> None:
        self.app = app
        self._engine_handlers = engine_handlers
        self._socket_path = socket_path
        self._bytes_per_token = _setting(bytes_per_token, BYTES_PER_TOKEN_ENV, 0)
        total_bytes = _setting(egress_total_bytes, EGRESS_TOTAL_ENV, DEFAULT_EGRESS_TOTAL_BYTES)
        self.egress_budget = EgressBudget(total_bytes)
        self._egress = EgressLimits(
            self.egress_budget,
            decoupled_bytes=_setting(egress_buffer_bytes, EGRESS_BUFFER_ENV, 0),
            detach_bytes=_setting(
                detach_buffer_bytes, DETACH_BUFFER_ENV, DEFAULT_DETACH_BUFFER_BYTES
            ),
        )
        self._coalescing = Coalescing(
            _setting(coalesce_bytes, COALESCE_BYTES_ENV, DEFAULT_COALESCE_BYTES),
            _setting(coalesce_ms, COALESCE_MS_ENV, DEFAULT_COALESCE_MS),
        )
        self._cancel_timeout_seconds = cancel_timeout_seconds
        self._reconnect_seconds = reconnect_seconds
        self._lock = threading.Lock()
        self.hook: EngineHook | None = None
        self._geometry: KvGeometry | None = None
        self._streams: dict[str, RequestStream] = {}
        self._numbers = itertools.count(1)
        self._warned_scope = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        hook, geometry = self._start(scope)
        stream = RequestStream(
            hook,
            geometry,
            self._connection(scope),
            f"asgi-{os.getpid()}-{next(self._numbers)}",
            header(scope, b"x-request-id"),
            self._register,
            send,
            self._egress,
            self._coalescing,
        )

        async def wrapped_receive() -> Message:
            return await stream.receive(receive)

        reason, returned = "aborted", False
        try:
            await self.app(scope, wrapped_receive, stream.send)
            reason, returned = ("finished" if stream.finished else "aborted"), True
        except Exception:
            if not stream.cancelled.is_set():
                raise
            # The app unwound through its disconnect path as asked; not an error to log.
        finally:
            await self._end(stream, reason, drain=returned)

    async def _end(self, stream: RequestStream, reason: str, *, drain: bool) -> None:
        """After the app returned: drop a cancelled stream's buffer and reset its connection,
        send what is buffered or gathered (only after a normal return: a failing or cancelled
        task drops it), close."""
        if stream.cancelled.is_set():
            stream.drop("cancelled by kvwatch")
            # A generator abandoned mid-`send` is closed only when it is collected, by the
            # loop's async-generator finalizer (vLLM aborts its request there), and the app's
            # exception handling may have left it in a reference cycle: collect once per cancel
            # (cancels are rare), then let the finalizer's turns run before answering.
            gc.collect()
            for _ in range(FINALIZER_TURNS):
                await asyncio.sleep(0)
        stream.app_done.set()
        await stream.end_egress(returned=drain)
        if stream.cancelled.is_set():
            reason = "cancelled"
        request_id = stream.request_id
        if stream.opened and request_id is not None:
            self._streams.pop(request_id, None)
            assert self.hook is not None, "a stream opens only through a started hook"
            self.hook.stream_closed(request_id, reason)

    def _register(self, stream: RequestStream) -> None:
        if stream.request_id is not None:
            self._streams[stream.request_id] = stream

    def _start(self, scope: Scope) -> tuple[EngineHook, KvGeometry]:
        """The process's hook and the engine's KV geometry, made on the first request."""
        with self._lock:
            if self.hook is None or self._geometry is None:
                geometry = detect(scope.get("app", self.app), self._bytes_per_token)
                engine = self._engine_handlers
                info = EngineInfo(
                    engine=(engine.engine if engine else None) or geometry.engine,
                    model=geometry.model,
                    pid=os.getpid(),
                    bytes_per_block=geometry.bytes_per_block,
                    device=geometry.device,
                    kv_blocks_total=0,
                )
                self.hook = EngineHook(
                    info,
                    self._cancel,
                    self._socket_path,
                    detach_handler=self._detach if self._egress.detach_bytes else None,
                    pause_handler=engine.pause if engine else self._pause,
                    release_handler=engine.release if engine else self._release,
                    park_handler=engine.park if engine else None,
                    cancel_timeout_seconds=self._cancel_timeout_seconds,
                    reconnect_seconds=self._reconnect_seconds,
                )
                self.hook.start()
                self._geometry = geometry
                _log.info(
                    "kvwatch hook for %s (%s); KV is estimated; %s",
                    info.engine,
                    info.model,
                    "the engine pauses and parks" if engine else "pauses hold the app's sends",
                )
            return self.hook, self._geometry

    def _connection(self, scope: Scope) -> Connection | None:
        connection = find_connection(scope)
        if connection is not None and not connection.from_socket and not self._warned_scope:
            self._warned_scope = True
            _log.warning(
                "kvwatch could not reach this ASGI server's socket; announcing the scope's "
                "addresses, which proxy headers may have rewritten (run uvicorn or hypercorn, "
                "or turn proxy headers off, so the agent can join streams to sockets)"
            )
        return connection

    def _cancel(self, request_id: str, reason: str) -> CommandOutcome:
        """The hook's cancel handler (a worker thread): the stream's own answer, or unknown."""
        stream = self._streams.get(request_id)
        if stream is None:
            return CommandOutcome(request_id, "unknown_request", 0, 0, "no such live stream")
        return stream.cancel_from_thread(reason, self._command_wait_seconds())

    def _detach(self, request_id: str, reason: str) -> CommandOutcome:
        """The hook's detach handler (a worker thread)."""
        return self._on_loop(request_id, lambda stream: stream.detach())

    def _pause(self, request_id: str, reason: str) -> CommandOutcome:
        """The hook's pause handler (a worker thread)."""
        return self._on_loop(request_id, lambda stream: stream.pause())

    def _release(self, request_id: str, reason: str) -> CommandOutcome:
        """The hook's release handler (a worker thread; the hook's own releases too)."""
        return self._on_loop(request_id, lambda stream: stream.release())

    def _on_loop(
        self,
        request_id: str,
        command: Callable[[RequestStream], Coroutine[Any, Any, CommandOutcome]],
    ) -> CommandOutcome:
        """The stream's own answer to `command`, run on its loop, or unknown."""
        stream = self._streams.get(request_id)
        if stream is None:
            return CommandOutcome(request_id, "unknown_request", 0, 0, "no such live stream")
        return stream.command_from_thread(command(stream), self._command_wait_seconds())

    def _command_wait_seconds(self) -> float:
        """How long a handler waits on the loop: a little less than the hook's own timeout."""
        return max(0.1, self._cancel_timeout_seconds - CANCEL_WAIT_MARGIN_SECONDS)

    def close(self) -> None:
        """Stops the hook thread (tests and embedders; a server process just exits)."""
        if self.hook is not None:
            self.hook.stop()


def wrapped_factory() -> Middleware:
    """`uvicorn --factory kvwatch.hook.asgi:wrapped_factory`: the app factory named by
    $KVWATCH_WRAP_FACTORY ("module:callable"), called, and wrapped."""
    target = os.environ.get(WRAP_FACTORY_ENV, "")
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"{WRAP_FACTORY_ENV} is {target!r}, not 'module:callable'",
            f"set {WRAP_FACTORY_ENV}=llama_cpp.server.app:create_app (or your app factory)",
        )
    factory = getattr(importlib.import_module(module_name), attribute)
    return Middleware(factory())


def _setting(value: int | None, env: str, default: int) -> int:
    if value is None:
        text = os.environ.get(env, "")
        try:
            value = int(text) if text else default
        except ValueError as exc:
            raise ConfigError(f"{env}={text!r} is not a whole number", f"unset {env}") from exc
    if value < 0:
        raise ConfigError(f"{env} must not be negative, got {value}", "pass 0 or more")
    return value
