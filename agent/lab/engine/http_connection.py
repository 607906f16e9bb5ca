"""The HTTP connection under each request: a small send buffer, and a way to reset it.

uvicorn's h11 protocol is extended in two ways:
- each accepted socket gets `SO_SNDBUF = sndbuf_bytes` (0 keeps the kernel's default,
  autotuned, often 4 MiB on loopback), and the asyncio write buffer a high-water mark of at
  most WRITE_BUFFER_BYTES, so a client that stops reading blocks the server's writes after
  tens of kilobytes instead of megabytes. This is what makes the coupled-mode pathology show
  quickly, and what tells the engine soon that its client holds it: a park is accepted once
  the writer is held (kvwatch.lab.engine.parking), and every kilobyte the engine buffers itself
  is generation it does after the socket filled.
- the connection's transport is put in the ASGI scope as the extension `kvwatch.transport`, so
  the app can end that exact connection with a TCP reset after a cancel.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

TRANSPORT_EXTENSION = "kvwatch.transport"
# The most the engine buffers in user space for one connection (uvicorn's default is 64 KiB).
WRITE_BUFFER_BYTES = 16 * 1024

_log = logging.getLogger("kvwatch.lab.engine")


def protocol_class(sndbuf_bytes: int) -> type[H11Protocol]:
    """An h11 protocol class for uvicorn's `http=` setting with the extensions above."""

    class KvwatchH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if sndbuf_bytes > 0:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf_bytes)
            high = min(sndbuf_bytes, WRITE_BUFFER_BYTES) if sndbuf_bytes else WRITE_BUFFER_BYTES
            transport.set_write_buffer_limits(high=high)
            app = self.app

            async def app_with_transport(scope: Any, receive: Any, send: Any) -> None:
                scope.setdefault("extensions", {})[TRANSPORT_EXTENSION] = transport
                await app(scope, receive, send)

            self.app = app_with_transport

    return KvwatchH11Protocol


def reset_connection(transport: asyncio.Transport) -> None:
    """Ends the connection with a TCP RST: SO_LINGER {on, 0 s}, then close without flushing.

    Call it on the event loop that owns the transport."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError as exc:  # already closed by the peer: nothing left to reset
            _log.debug("no reset, socket is gone: %s", exc)
    transport.abort()
