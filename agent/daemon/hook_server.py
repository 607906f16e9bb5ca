"""`HookServer`: the agent side of the engine-hook protocol (docs/protocol.md), on asyncio."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Collection, Mapping
from typing import Any

from kvwatch import __version__
from kvwatch.daemon.hook_connection import EngineConnection, PeerCredentials
from kvwatch.daemon.hook_registry import (
    ChangeCallback,
    EngineStream,
    HookCounters,
    StreamRegistry,
)
from kvwatch.daemon.hook_socket import bind_listening_socket, peer_credentials, remove_socket_file
from kvwatch.errors import ConfigError
from kvwatch.hook.api import CancelOutcome
from kvwatch.sockets import Endpoint

__all__ = ["EngineStream", "HookServer"]

ROOT_UID = 0
DEFAULT_MAX_CONNECTIONS = 256
CLOSE_WAIT_SECONDS = 2.0

_log = logging.getLogger("kvwatch.daemon.hook")


class HookServer:
    """Listens on the engine socket, tracks the streams engines announce, sends their cancels.

    The daemon owns the server and uses it from one event loop only. Each accepted connection
    is checked with SO_PEERCRED: its uid must be root or on `allowed_uids`, else it gets an
    `error` and is closed. Root is always allowed because it could bypass the check anyway
    (read any engine's state, signal it, destroy its sockets); refusing it protects nothing.
    Invariants: `streams()` holds exactly what the connected engines' current sessions
    announced and have not closed; `on_change(request_id, stream or None)` is called on the
    event loop for every change, None when a stream is gone (close, cancel, session reset,
    disconnect, server close); nothing an engine sends raises out of the server.
    """

    def __init__(
        self,
        socket_path: str,
        allowed_uids: Collection[int] = (ROOT_UID,),
        *,
        on_change: ChangeCallback | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        agent_name: str = f"kvwatch {__version__}",
    ) -> None:
        for uid in allowed_uids:
            if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
                raise ConfigError(
                    f"allowed engine uid {uid!r} is not a uid", "list numeric uids (0 or more)"
                )
        if max_connections < 1:
            raise ConfigError(
                f"max_connections must be at least 1, got {max_connections}",
                "allow at least one engine connection",
            )
        self.socket_path = socket_path
        self.allowed_uids = frozenset(allowed_uids) | {ROOT_UID}
        self._max_connections = max_connections
        self._agent_name = agent_name
        self._counters = HookCounters()
        self._registry = StreamRegistry(self._counters, on_change)
        self._connections: dict[int, EngineConnection] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connection_ids = itertools.count(1)
        self._correlation_ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._inode = 0

    async def start(self) -> None:
        """Binds the socket (mode 0660) and starts accepting; ConfigError/PrivilegeError if not."""
        if self._server is not None:
            return
        sock, self._inode = await bind_listening_socket(self.socket_path)
        try:
            self._server = await asyncio.start_unix_server(self._accept, sock=sock)
        except OSError:
            sock.close()
            remove_socket_file(self.socket_path, self._inode)
            raise
        _log.info("engine hook server listening on %s", self.socket_path)

    async def close(self) -> None:
        """Stops accepting, closes every connection (forgetting their streams), removes the file."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for connection in list(self._connections.values()):
            connection.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_SECONDS)
        await server.wait_closed()
        remove_socket_file(self.socket_path, self._inode)

    def streams(self) -> list[EngineStream]:
        return self._registry.streams()

    def find(self, local: Endpoint, remote: Endpoint) -> EngineStream | None:
        """The live stream on this TCP 4-tuple (the server socket's view), newest first."""
        return self._registry.find(local, remote)

    def engines(self) -> list[dict[str, object]]:
        """One entry per connection that said hello: who it is and how many streams it has.

        `pid` is the kernel's (SO_PEERCRED, the agent's pid namespace), `hello_pid` what the
        engine announced (its own namespace).
        """
        return [
            {
                "pid": connection.peer.pid,
                "hello_pid": hello.pid,
                "uid": connection.peer.uid,
                "engine": hello.engine,
                "model": hello.model,
                "device": hello.device,
                "bytes_per_block": hello.bytes_per_block,
                "kv_blocks_total": hello.kv_blocks_total,
                "streams": self._registry.owned_count(connection_id),
            }
            for connection_id, connection in self._connections.items()
            if (hello := connection.hello) is not None
        ]

    async def cancel(
        self,
        request_id: str,
        reason: str,
        evidence: Mapping[str, object],
        timeout_seconds: float = 2.0,
    ) -> CancelOutcome:
        """Asks the engine owning the stream to cancel it; returns the engine's outcome.

        Unknown request: `unknown_request` without sending anything. No answer in time or the
        engine disconnecting: `failed` (the KV must be assumed still held).
        """
        if timeout_seconds <= 0:
            raise ConfigError(
                f"cancel timeout must be positive, got {timeout_seconds}", "pass seconds > 0"
            )
        owner = self._registry.owner_of(request_id)
        connection = self._connections.get(owner) if owner is not None else None
        if connection is None:
            self._counters.add("cancels_unknown_request")
            return CancelOutcome(
                request_id, "unknown_request", 0, 0, detail="no connected engine announced it"
            )
        correlation_id = f"c-{next(self._correlation_ids)}"
        return await connection.cancel(
            request_id, reason, evidence, correlation_id, timeout_seconds
        )

    def counters(self) -> dict[str, int]:
        """Event counts since construction, plus the gauges `connections` and `live_streams`."""
        return {
            **self._counters.snapshot(),
            "connections": len(self._connections),
            "live_streams": len(self._registry),
        }

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except Exception:  # a server bug must not end the daemon; the connection is lost
            self._counters.add("internal_errors")
            _log.exception("engine hook connection failed")
            writer.transport.abort()
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:  # accepted just before close()
            writer.transport.abort()
            return
        try:
            peer = peer_credentials(writer.get_extra_info("socket"))
        except OSError as exc:
            _log.debug("engine connection gone before its credentials were read: %s", exc)
            writer.transport.abort()
            return
        connection_id = next(self._connection_ids)
        connection = EngineConnection(
            connection_id, reader, writer, peer, self._registry, self._counters, self._agent_name
        )
        refusal = self._refusal(peer)
        if refusal is not None:
            await connection.refuse(*refusal)
            return
        self._counters.add("connections_accepted")
        self._connections[connection_id] = connection
        try:
            await connection.serve()
        finally:
            del self._connections[connection_id]  # in the step that forgot its streams
        await connection.finish()

    def _refusal(self, peer: PeerCredentials) -> tuple[str, str] | None:
        """(message, hint) when this peer may not connect, counted; None when it may."""
        if peer.uid not in self.allowed_uids:
            self._counters.add("peers_refused")
            _log.warning("refused engine hook peer pid %d: uid %d not allowed", peer.pid, peer.uid)
            return (
                f"uid {peer.uid} may not use the kvwatch engine socket",
                "run the engine as a uid on the agent's allow-list, or add "
                f"{peer.uid} to the agent's allowed engine uids",
            )
        if len(self._connections) >= self._max_connections:
            self._counters.add("connections_refused_busy")
            return (
                f"the agent already serves {self._max_connections} engine connections",
                "use one connection per engine process, or raise the agent's connection limit",
            )
        return None
