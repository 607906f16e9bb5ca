"""`EngineServer`: one engine served over HTTP by uvicorn, with the kvwatch hook attached."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import uvicorn

from kvwatch.errors import ConfigError
from kvwatch.hook import EngineHook, EngineInfo
from kvwatch.lab.engine.app import StreamObserver, build_app
from kvwatch.lab.engine.config import DEFAULT_SNDBUF_BYTES
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.http_connection import protocol_class

ENGINE_NAME = "kvwatch-reference"
GRACEFUL_SHUTDOWN_SECONDS = 3
START_TIMEOUT_SECONDS = 30.0

_log = logging.getLogger("kvwatch.lab.engine")


def engine_info(engine: Engine) -> EngineInfo:
    """What the hook announces to the agent about this engine."""
    description = engine.description
    return EngineInfo(
        engine=ENGINE_NAME,
        model=description.model,
        pid=os.getpid(),
        bytes_per_block=description.bytes_per_block,
        device=description.device,
        kv_blocks_total=description.kv_blocks_total,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ConfigError (with what to do) when the address is unusable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}",
            "pick another --port (0 takes a free one) or stop what is using it",
        ) from exc
    sock.listen(2048)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, stopping the engine first at shutdown so open streams end at once
    (finish reason "abort") instead of holding the graceful-shutdown wait."""

    def __init__(self, config: uvicorn.Config, before_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._before_shutdown = before_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._before_shutdown()
        await super().shutdown(sockets)


class EngineServer:
    """Serves an engine until stopped. It owns the engine's and the hook's lifetime from
    `run`/`start_in_thread` on: it starts both, and stops both when the server stops.

    `sndbuf_bytes` is the send buffer of each accepted connection (see
    `kvwatch.lab.engine.http_connection`); `observer` is the kvwatch hook, or None to run
    without one.
    """

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        sndbuf_bytes: int = DEFAULT_SNDBUF_BYTES,
        hook: HookLike | None = None,
        log_level: str = "warning",
    ) -> None:
        self.engine = engine
        self.hook = hook
        self._socket = bind_socket(host, port)
        bound = self._socket.getsockname()
        self.address: tuple[str, int] = (bound[0], bound[1])
        config = uvicorn.Config(
            build_app(engine, hook),
            http=protocol_class(sndbuf_bytes),
            lifespan="off",
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
        self._server = _Uvicorn(config, engine.stop)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.address[0]}]" if ":" in self.address[0] else self.address[0]
        return f"http://{host}:{self.address[1]}"

    def run(self) -> None:
        """Serves on this thread until `stop` (or SIGINT/SIGTERM on the main thread)."""
        self.engine.start()
        if self.hook is not None:
            self.hook.start()
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        finally:
            self.engine.stop()
            if self.hook is not None:
                self.hook.stop()
            self._socket.close()

    def start_in_thread(self) -> None:
        """Serves on a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="kvwatch-engine-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the engine's HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Asks the server to stop; joins its thread when it runs on one."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(GRACEFUL_SHUTDOWN_SECONDS + 10)


class HookLike(StreamObserver, Protocol):
    """The kvwatch hook as the server uses it: a stream observer that starts and stops."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def attach_hook(engine: Engine, socket_path: str | None) -> HookLike:
    """Builds the kvwatch hook for this engine: cancels from the agent run `Engine.cancel`,
    parks `Engine.park` unless parking is off, pauses and releases `Engine.pause` and
    `Engine.release` unless pausing is off (the hello then does not offer "park", "pause").
    The hook releases a paused or parked request itself when the agent's lease runs out or
    its connection ends.

    The hook connects in the background; with no agent present the engine runs normally."""
    config = engine.config
    return EngineHook(
        engine_info(engine),
        engine.cancel,
        socket_path,
        park_handler=engine.park if config.park else None,
        pause_handler=engine.pause if config.pause else None,
        release_handler=engine.release if config.pause else None,
    )
