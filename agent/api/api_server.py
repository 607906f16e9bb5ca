"""`ApiServer`: serves the HTTP API (kvwatch.api.routes) on connections it accepts itself, so
that a flood of them cannot take the agent's descriptors or its event loop (issue #13).

uvicorn's HTTP protocol handles each connection; uvicorn's server (its accept loop, its signal
handling) is not used. docs/agent.md ("HTTP API limits") states the budgets below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.server import ServerState

from kvwatch.accept import AcceptLoop

DEFAULT_MAX_CONNECTIONS = 64
# A connection is asked to finish after REQUEST_SECONDS: an idle one, or one still sending its
# request, closes at once; one receiving an answer closes after it. Past HARD_SECONDS it is cut.
REQUEST_SECONDS = 10.0
HARD_SECONDS = 60.0
KEEP_ALIVE_SECONDS = 5
SWEEP_SECONDS = 1.0
CLOSE_SECONDS = 2.0

_log = logging.getLogger("kvwatch.api.routes")


@dataclass
class _Connection:
    sock: socket.socket
    accepted: float
    protocol: Any = None  # uvicorn's protocol instance, once the transport exists
    asked_to_finish: bool = False

    @property
    def closed(self) -> bool:
        return self.sock.fileno() == -1  # the transport closes the socket when it is done

    def finish(self) -> None:
        """Graceful: idle or half-sent requests close now, an answer in flight completes."""
        self.asked_to_finish = True
        if self.protocol is not None:
            self.protocol.shutdown()

    def cut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class ApiServer:
    """Serves `app` on `listener` (bound, not yet listening; see kvwatch.daemon.preflight).

    Owned by the daemon's event loop. Budgets: at most `max_connections` connections (a new
    one closes the oldest when full: a real client sends its request at once, a hog waits);
    each connection is asked to finish REQUEST_SECONDS after accept and is cut at HARD_SECONDS.
    """

    def __init__(
        self,
        app: Starlette,
        listener: socket.socket,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.listener = listener
        self.connections_dropped = 0
        self._max_connections = max_connections
        self._config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
        self._config.load()
        self._state = ServerState()
        self._connections: OrderedDict[int, _Connection] = OrderedDict()
        self._next_id = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._serving: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return str(host), int(port)

    def connection_count(self) -> int:
        return sum(not connection.closed for connection in self._connections.values())

    async def start(self) -> None:
        self.listener.listen(self._config.backlog)
        self.listener.setblocking(False)
        accept = AcceptLoop("HTTP API", self.listener, self._accepted, self._drop_oldest)
        self._tasks = [
            asyncio.create_task(accept.run()),
            asyncio.create_task(self._sweep_forever()),
        ]

    async def close(self) -> None:
        """Stops accepting, lets answers in flight finish (up to CLOSE_SECONDS), cuts the rest."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.listener.close()
        for connection in self._connections.values():
            connection.finish()
        deadline = time.monotonic() + CLOSE_SECONDS
        while self.connection_count() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for connection in self._connections.values():
            connection.cut()
        self._connections.clear()

    def _accepted(self, sock: socket.socket) -> None:
        if len(self._connections) >= self._max_connections:
            self._sweep(time.monotonic())
            if len(self._connections) >= self._max_connections:
                self._drop_oldest()
        self._next_id += 1
        connection = self._connections[self._next_id] = _Connection(sock, time.monotonic())
        task = asyncio.create_task(self._serve(connection))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, connection: _Connection) -> None:
        def protocol() -> asyncio.Protocol:
            connection.protocol = self._config.http_protocol_class(  # type: ignore[call-arg]
                config=self._config, server_state=self._state, app_state={}
            )
            return connection.protocol  # type: ignore[no-any-return]

        try:
            await asyncio.get_running_loop().connect_accepted_socket(protocol, connection.sock)
        except OSError as exc:  # the peer left before the transport existed
            _log.debug("HTTP API connection lost at once: %s", exc)
            connection.sock.close()

    def _drop_oldest(self) -> None:
        """Cuts the oldest connection still open (to make room, or to free a descriptor)."""
        while self._connections:
            _, connection = self._connections.popitem(last=False)
            if not connection.closed:
                self.connections_dropped += 1
                _log.warning(
                    "HTTP API: over %d connections; closed the oldest (a client that holds "
                    "connections open without asking anything?)",
                    self._max_connections,
                )
                connection.cut()
                return

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            self._sweep(time.monotonic())

    def _sweep(self, now: float) -> None:
        """Forgets closed connections, asks old ones to finish, cuts the oldest."""
        for key, connection in list(self._connections.items()):
            age = now - connection.accepted
            if connection.closed:
                del self._connections[key]
            elif age >= HARD_SECONDS:
                connection.cut()
            elif age >= REQUEST_SECONDS and not connection.asked_to_finish:
                connection.finish()
