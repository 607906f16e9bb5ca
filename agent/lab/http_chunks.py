"""Reading an HTTP/1.1 chunked response chunk by chunk, as the server wrote it: h11 (uvicorn,
hypercorn) sends each ASGI body message as one chunk, so the chunks are the server's writes.
Used by the coalescing tests of the reference engine and the ASGI middleware."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field

CREATED = re.compile(rb'"created":\s*\d+')


@dataclass
class ChunkedResponse:
    """The chunks of one response, each with when it arrived (monotonic seconds), read on a
    thread of its own from a socket that sent its request; `ended` is set at the last chunk
    (or when the connection ends)."""

    sock: socket.socket
    chunks: list[bytes] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    head: bytes = b""

    def start(self) -> ChunkedResponse:
        threading.Thread(target=self._read, name="test-chunked-reader", daemon=True).start()
        return self

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def events(self) -> list[bytes]:
        """The `data:` events received so far, whole ones only."""
        whole = self.body.split(b"\n\n")[:-1]  # the last part is unfinished (or empty)
        return [event for event in whole if event.startswith(b"data: ")]

    def _read(self) -> None:
        self.sock.settimeout(60.0)
        buffer = b""
        try:
            while b"\r\n\r\n" not in buffer:
                buffer += self._recv()
            self.head, buffer = buffer.split(b"\r\n\r\n", 1)
            while True:
                while b"\r\n" not in buffer:
                    buffer += self._recv()
                size_line, buffer = buffer.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                while len(buffer) < size + 2:
                    buffer += self._recv()
                if size == 0:
                    return
                self.chunks.append(buffer[:size])
                self.arrived.append(time.monotonic())
                buffer = buffer[size + 2 :]
        except (OSError, ValueError):
            return
        finally:
            self.ended.set()

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data


def without_created(body: bytes) -> bytes:
    """A response body with its `created` timestamps blanked (they differ between runs)."""
    return CREATED.sub(b'"created":0', body)


def dechunked(raw: bytes) -> bytes:
    """The body of a whole chunked HTTP/1.1 response (`raw`: from its status line on)."""
    rest = raw.split(b"\r\n\r\n", 1)[1]
    body = bytearray()
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]
