"""`HookServer`: the agent side of the engine-hook protocol (docs/protocol.md), on asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvwatch import __version__
from kvwatch.accept import AcceptLoop
from kvwatch.errors import ConfigError
from kvwatch.hookserver.engine_connection import EngineConnection, PeerCredentials
from kvwatch.hookserver.listen import bind_listening_socket, peer_credentials, remove_socket_file
from kvwatch.hookserver.registry import (
    COUNTER_NAMES,
    ChangeCallback,
    EngineStream,
    StreamRegistry,
)
from kvwatch.hookwire.commands import command_kind
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import plural
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.sockets import Endpoint

__all__ = ["EngineStream", "HookServer"]

ROOT_UID = 0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HELLO_SECONDS = 5.0
LISTEN_BACKLOG = 128
# Connections being refused (an error line, then close) at once; more are closed unanswered.
MAX_REFUSING = 32
CLOSE_WAIT_SECONDS = 2.0

_log = logging.getLogger("kvwatch.hookserver")


@dataclass
class _Admitted:
    """An accepted connection the server serves: its socket, and its EngineConnection once
    the streams around the socket exist."""

    peer: PeerCredentials
    sock: socket.socket
    connection: EngineConnection | None = None

    @property
    def silent(self) -> bool:
        """No hello yet: not an engine session, so it may be dropped to make room."""
        return self.connection is None or self.connection.hello is None

    def drop(self) -> None:
        """Ends the connection whatever stage it is in: its reader sees end of stream."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class HookServer:
    """Listens on the engine socket, tracks the streams engines announce, sends them commands
    (kvwatch.hookwire.commands: cancel, park, detach, pause, release).

    The daemon owns the server and uses it from one event loop only. Each accepted connection
    is checked with SO_PEERCRED: its uid must be root or on `allowed_uids`, else it gets an
    `error` and is closed. Root is always allowed because it could bypass the check anyway
    (read any engine's state, signal it, destroy its sockets); refusing it protects nothing.
    Invariants: `streams()` holds exactly what the connected engines' current sessions
    announced and have not closed; `on_change(request_id, stream or None)` is called on the
    event loop for every change, None when a stream is gone (close, cancel, session reset,
    disconnect, server close); nothing an engine sends raises out of the server.

    Budgets (docs/protocol.md, "Limits"): at most `max_connections` connections, at most
    `max_connections_per_uid` of them from one uid; a connection that has not said hello within
    `hello_seconds` is closed, and one that has not said hello yet is closed to make room for a
    new one when a budget is full (engines say hello at once, so only the silent lose).
    """

    def __init__(
        self,
        socket_path: str,
        allowed_uids: Collection[int] = (ROOT_UID,),
        *,
        on_change: ChangeCallback | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_uid: int | None = None,
        hello_seconds: float = DEFAULT_HELLO_SECONDS,
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
        if hello_seconds <= 0:
            raise ConfigError(
                f"hello_seconds must be positive, got {hello_seconds}", "pass seconds > 0"
            )
        self.socket_path = socket_path
        self.allowed_uids = frozenset(allowed_uids) | {ROOT_UID}
        self._max_connections = max_connections
        self._max_per_uid = max_connections_per_uid or max(1, max_connections // 2)
        self._hello_seconds = hello_seconds
        self._agent_name = agent_name
        self._counters = EventCounters(COUNTER_NAMES)
        self._registry = StreamRegistry(self._counters, on_change)
        self._admitted: dict[int, _Admitted] = {}
        self._per_uid: Counter[int] = Counter()
        self._refusing = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connection_ids = itertools.count(1)
        self._correlation_ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._inode = 0

    async def start(self) -> None:
        """Binds the socket (mode 0660) and starts accepting; ConfigError/PrivilegeError if not."""
        if self._listener is not None:
            return
        sock, self._inode = await bind_listening_socket(self.socket_path)
        sock.listen(LISTEN_BACKLOG)
        self._listener = sock
        accept = AcceptLoop("engine hook", sock, self._accepted, self._drop_oldest_silent)
        self._accepting = asyncio.create_task(accept.run())
        _log.info("engine hook server listening on %s", self.socket_path)

    async def close(self) -> None:
        """Stops accepting, closes every connection (forgetting their streams), removes the file."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        listener.close()
        for admitted in list(self._admitted.values()):
            admitted.drop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_SECONDS)
        remove_socket_file(self.socket_path, self._inode)

    def streams(self) -> list[EngineStream]:
        return self._registry.streams()

    def find(self, local: Endpoint, remote: Endpoint) -> EngineStream | None:
        """The live stream on this TCP 4-tuple (the server socket's view), newest first."""
        return self._registry.find(local, remote)

    def live(self, request_id: str) -> bool:
        """Whether the engine still announces this request (it has not closed it)."""
        return self._registry.get(request_id) is not None

    def serves(self, local: Endpoint) -> bool:
        """Whether an engine announced a stream on this server address in this session."""
        return self._registry.serves(local)

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
                "features": list(hello.features),
                "streams": self._registry.owned_count(connection_id),
            }
            for connection_id, admitted in self._admitted.items()
            if (connection := admitted.connection) is not None
            and (hello := connection.hello) is not None
        ]

    async def command(
        self,
        name: str,
        request_id: str,
        reason: str,
        evidence: Mapping[str, object],
        timeout_seconds: float = 2.0,
        *,
        lease_ms: int = 0,
    ) -> CommandOutcome:
        """Sends the command called `name` (a row of kvwatch.hookwire.commands.COMMAND_KINDS:
        cancel, park, detach, pause, release) to the engine that announced the request;
        returns the engine's outcome (docs/protocol.md says what each status means).
        `lease_ms` is a pause's or a park's lease (0: the engine hook's default).

        Unknown request: `unknown_request` without sending anything. No answer in time or the
        engine disconnecting: `failed` (what the command would have freed must be assumed
        still held). ValueError for a command name that is not in the table.
        """
        kind = command_kind(name)
        if timeout_seconds <= 0:
            raise ConfigError(
                f"{name} timeout must be positive, got {timeout_seconds}", "pass seconds > 0"
            )
        owner = self._registry.owner_of(request_id)
        admitted = self._admitted.get(owner) if owner is not None else None
        connection = admitted.connection if admitted is not None else None
        if connection is None:
            self._counters.add(f"{plural(name)}_unknown_request")
            return CommandOutcome(
                request_id, "unknown_request", detail="no connected engine announced it"
            )
        correlation_id = f"{name[0]}-{next(self._correlation_ids)}"
        lease = {"lease_ms": lease_ms} if lease_ms else {}
        command = kind.command(
            request_id=request_id,
            reason=reason,
            correlation_id=correlation_id,
            evidence=dict(evidence),
            **lease,
        )
        return await connection.command(command, timeout_seconds)

    def counters(self) -> dict[str, int]:
        """Event counts since construction (monotonic; the gauges are `connection_count` and
        `len(streams())`)."""
        return self._counters.snapshot()

    def connection_count(self) -> int:
        """Engine connections open now, whether or not they said hello yet."""
        return len(self._admitted)

    def _accepted(self, sock: socket.socket) -> None:
        """Admits or refuses a new connection at once (budgets count from accept on)."""
        if self._listener is None:  # accepted just before close()
            sock.close()
            return
        try:
            peer = peer_credentials(sock)
        except OSError as exc:
            _log.debug("engine connection gone before its credentials were read: %s", exc)
            sock.close()
            return
        connection_id = next(self._connection_ids)
        refusal = self._refusal(peer)
        if refusal is None:
            self._counters.add("connections_accepted")
            self._admitted[connection_id] = _Admitted(peer, sock)
            self._per_uid[peer.uid] += 1
        elif self._refusing >= MAX_REFUSING:
            sock.close()  # a refusal flood: no error line for the rest
            return
        task = asyncio.create_task(self._run(connection_id, sock, peer, refusal))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self,
        connection_id: int,
        sock: socket.socket,
        peer: PeerCredentials,
        refusal: tuple[str, str] | None,
    ) -> None:
        self._refusing += refusal is not None
        try:
            connection = await self._wrap(connection_id, sock, peer)
            if connection is None:
                return
            if refusal is not None:
                await connection.refuse(*refusal)
            else:
                await self._serve(connection_id, connection)
        except Exception:  # a server bug must not end the daemon; the connection is lost
            self._counters.add("internal_errors")
            _log.exception("engine hook connection failed")
            sock.close()
        finally:
            self._refusing -= refusal is not None
            self._release(connection_id)

    async def _wrap(
        self, connection_id: int, sock: socket.socket, peer: PeerCredentials
    ) -> EngineConnection | None:
        """The connection with asyncio streams around its socket; None if it is already gone."""
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except OSError as exc:
            _log.debug("engine connection %d lost before it was served: %s", connection_id, exc)
            sock.close()
            return None
        return EngineConnection(
            connection_id, reader, writer, peer, self._registry, self._counters, self._agent_name
        )

    async def _serve(self, connection_id: int, connection: EngineConnection) -> None:
        admitted = self._admitted.get(connection_id)
        if admitted is None:  # dropped to make room before its streams existed
            connection.close()
            return
        admitted.connection = connection
        deadline = asyncio.get_running_loop().call_later(
            self._hello_seconds, self._hello_deadline, connection_id
        )
        try:
            await connection.serve()
        finally:
            deadline.cancel()
            self._release(connection_id)  # in the step that forgot its streams
        await connection.finish()

    def _release(self, connection_id: int) -> None:
        admitted = self._admitted.pop(connection_id, None)
        if admitted is not None:
            self._per_uid[admitted.peer.uid] -= 1
            if not self._per_uid[admitted.peer.uid]:
                del self._per_uid[admitted.peer.uid]

    def _hello_deadline(self, connection_id: int) -> None:
        admitted = self._admitted.get(connection_id)
        if admitted is not None and admitted.silent:
            self._counters.add("hello_timeouts")
            _log.info(
                "engine hook connection from pid %d said no hello within %g s; closed",
                admitted.peer.pid,
                self._hello_seconds,
            )
            admitted.drop()

    def _drop_oldest_silent(self, uid: int | None = None) -> bool:
        """Closes the oldest connection (of `uid`, if given) that said no hello; False if none."""
        for connection_id, admitted in self._admitted.items():
            if admitted.silent and uid in (None, admitted.peer.uid):
                self._counters.add("silent_connections_dropped")
                admitted.drop()
                self._release(connection_id)
                return True
        return False

    def _refusal(self, peer: PeerCredentials) -> tuple[str, str] | None:
        """(message, hint) when this peer may not connect, counted; None when it may.
        A full budget first drops a connection that said no hello, to make room."""
        if peer.uid not in self.allowed_uids:
            self._counters.add("peers_refused")
            _log.warning("refused engine hook peer pid %d: uid %d not allowed", peer.pid, peer.uid)
            return (
                f"uid {peer.uid} may not use the kvwatch engine socket",
                "run the engine as a uid on the agent's allow-list, or add "
                f"{peer.uid} to the agent's allowed engine uids",
            )
        if self._per_uid[peer.uid] >= self._max_per_uid and not self._drop_oldest_silent(peer.uid):
            self._counters.add("connections_refused_busy")
            return (
                f"uid {peer.uid} already has {self._max_per_uid} engine connections",
                "use one connection per engine process, or raise the agent's per-uid limit",
            )
        if len(self._admitted) >= self._max_connections and not self._drop_oldest_silent():
            self._counters.add("connections_refused_busy")
            return (
                f"the agent already serves {self._max_connections} engine connections",
                "use one connection per engine process, or raise the agent's connection limit",
            )
        return None
