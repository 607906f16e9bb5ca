"""The TCP connection behind an ASGI request: its real addresses, and a reset that ends it.

ASGI gives an app `scope["client"]`, which uvicorn (`--proxy-headers`) and hypercorn
(`ProxyFixMiddleware`) rewrite from X-Forwarded-For / Forwarded headers, so it is not the
socket the kernel reports. The server's asyncio transport is: uvicorn runs each request in a
task whose coroutine is `RequestResponseCycle.run_asgi(self, ...)` with `self.transport`;
hypercorn runs `_handle(app, ..., send, ...)` where `send` leads, through bound methods, to the
`TCPServer` whose `writer.transport` is the connection. `find_transport` walks from the current
task's coroutines along those few attribute names, so it survives middleware that wrap
`send` (Starlette's ServerErrorMiddleware) and any other server built the same way. A
transport is an `asyncio.BaseTransport` or an object with its methods: uvloop's transports
(vLLM serves on uvloop) do not derive from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass
from types import CoroutineType, FrameType
from typing import Any

# Attributes that lead from a server's request object towards its transport.
_LINKS = ("transport", "_transport", "writer", "send", "_send", "__self__")
_MAX_DEPTH = 6
# What a transport that does not derive from asyncio.BaseTransport must have to be taken as one.
_TRANSPORT_METHODS = ("get_extra_info", "is_closing", "abort", "write")
_MAX_COROUTINES = 32


@dataclass(frozen=True)
class Connection:
    """A request's TCP 4-tuple, as the server socket sees it, and how to end it."""

    local: tuple[str, int]
    remote: tuple[str, int]
    transport: asyncio.BaseTransport | None
    from_socket: bool

    def closed(self) -> bool:
        """Whether the connection is known to be closing or closed (False when unknown)."""
        return self.transport is not None and self.transport.is_closing()

    def reset(self) -> bool:
        """Ends the connection with a TCP reset (SO_LINGER 0, then abort); False if unknown."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        abort = getattr(transport, "abort", None)
        if abort is None:
            transport.close()
        else:
            abort()
        return True


def find_connection(scope: MutableMapping[str, Any]) -> Connection | None:
    """The current request's connection from its transport's socket, else from the scope
    (`from_socket` False: proxy headers may have rewritten it); None when neither has it."""
    transport = find_transport()
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            return Connection(_pair(sock.getsockname()), _pair(sock.getpeername()), transport, True)
        except OSError:  # the peer is already gone
            return None
    server, client = scope.get("server"), scope.get("client")
    if server and client:
        return Connection(_pair(server), _pair(client), transport, False)
    return None


def find_transport() -> asyncio.BaseTransport | None:
    """The asyncio transport of the server connection running the current task, or None."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    if task is None:
        return None
    for frame in _frames(task.get_coro()):
        for value in frame.f_locals.values():
            found = _search(value, _MAX_DEPTH, set())
            if found is not None:
                return found
    return None


def _frames(coro: Any) -> list[FrameType]:
    """The frames of the coroutine chain a task is awaiting, outermost first."""
    frames: list[FrameType] = []
    while coro is not None and len(frames) < _MAX_COROUTINES:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = coro.cr_await if isinstance(coro, CoroutineType) else None
    return frames


def _is_transport(value: Any) -> bool:
    if isinstance(value, asyncio.BaseTransport):
        return True
    return all(callable(getattr(type(value), name, None)) for name in _TRANSPORT_METHODS)


def _search(value: Any, depth: int, seen: set[int]) -> asyncio.BaseTransport | None:
    if _is_transport(value):
        transport: asyncio.BaseTransport = value
        return transport
    if isinstance(value, asyncio.StreamWriter):
        return value.transport
    if depth == 0 or id(value) in seen or isinstance(value, str | bytes | int | float | dict):
        return None
    seen.add(id(value))
    for name in _LINKS:
        try:
            linked = getattr(value, name, None)
        except Exception:  # a foreign property may raise anything; it is not the transport
            continue
        if linked is not None:
            found = _search(linked, depth - 1, seen)
            if found is not None:
                return found
    return None


def _pair(address: Any) -> tuple[str, int]:
    return (str(address[0]), int(address[1]))
