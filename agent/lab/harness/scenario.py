"""Loopback clients that show the three behaviours kvwatch must tell apart.

A `Scenario` runs a small TCP server that streams token-sized writes to every client that
asks for a stream, as an SSE server does. Clients come in four kinds:
- healthy: reads everything as it arrives;
- slow: drains 4 KB every 100 ms (a zero window much of the time, yet ACKs keep moving);
- stalled: a small receive buffer, reads the first bytes, then never reads again but keeps
  the connection open;
- idle: connected, nothing is ever written to it.
Used by `kvwatch demo`, the tests and the benchmarks. Everything stays on loopback.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

ClientKind = Literal["healthy", "slow", "stalled", "idle"]
CLIENT_KINDS: tuple[ClientKind, ...] = ("healthy", "slow", "stalled", "idle")
STALLED_RCVBUF_BYTES = 4096
SLOW_READ_BYTES = 4096
SLOW_READ_INTERVAL_SECONDS = 0.1
# Loopback's 64 KiB MTU makes a receiver hold its window shut until it has read a whole
# 64 KiB segment's worth; clients advertise the MSS of an Ethernet path instead, so window
# updates (and ACK progress) come at the pace a real network shows.
CLIENT_MSS_BYTES = 1448
# A reader that stopped at a zero window is found again by the sender's zero-window probes,
# whose interval backs off (0.2, 0.4, 0.8 s ...). With a fixed 16 KiB receive buffer (no
# autotuning) and 4 KiB read every 100 ms, the window is zero ~70% of the time and the ACK
# point still moves at least every ~0.7 s (measured on loopback, kernel 6.18).
SLOW_RCVBUF_BYTES = 16384


def abort(sock: socket.socket) -> None:
    """Wakes any thread blocked on the socket, then closes it with a reset (no lingering)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass
class ScenarioClient:
    """One client connection and the thread that reads for it (none for stalled and idle)."""

    kind: ClientKind
    sock: socket.socket
    local_port: int
    stop: threading.Event = field(default_factory=threading.Event)
    bytes_read: int = 0
    reader: threading.Thread | None = None

    def start_reading(self) -> None:
        """Makes a stalled client read again, draining as fast as it can."""
        self.kind = "healthy"
        self.reader = threading.Thread(target=self._read_loop, daemon=True)
        self.reader.start()

    def close(self) -> None:
        """Stops reading and closes the connection normally (FIN)."""
        self.stop.set()
        if self.reader is not None:
            self.reader.join(timeout=2)
        self.sock.close()

    def _read_loop(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                size = SLOW_READ_BYTES if self.kind == "slow" else 1 << 16
                data = self.sock.recv(size)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            self.bytes_read += len(data)
            if self.kind == "slow":
                self.stop.wait(SLOW_READ_INTERVAL_SECONDS)


class Scenario:
    """A loopback streaming server plus its clients. Owns every socket and thread it starts;
    `close()` (or leaving the context) ends them all."""

    def __init__(
        self,
        family: int = socket.AF_INET,
        chunk_bytes: int = 256,
        write_interval_seconds: float = 0.0,
    ) -> None:
        self.family = family
        self.host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        self.chunk = b"data: " + b"x" * max(1, chunk_bytes - 8) + b"\n\n"
        self.write_interval_seconds = write_interval_seconds
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((self.host, 0))
        self.listener.listen(4096)
        self.port: int = self.listener.getsockname()[1]
        self.clients: list[ScenarioClient] = []
        self.server_sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept_loop, daemon=True)
        self._accepting.start()

    def _accept_loop(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.server_sockets.append(conn)
            writer = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(writer)
            writer.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            request = conn.recv(64)
            if not request.startswith(b"stream"):
                return
            while not self._stop.is_set():
                conn.sendall(self.chunk)
                if self.write_interval_seconds:
                    self._stop.wait(self.write_interval_seconds)

    def connect(self, kind: ClientKind) -> ScenarioClient:
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, CLIENT_MSS_BYTES)
        if kind in ("stalled", "slow"):
            rcvbuf = STALLED_RCVBUF_BYTES if kind == "stalled" else SLOW_RCVBUF_BYTES
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect((self.host, self.port))
        client = ScenarioClient(kind, sock, sock.getsockname()[1])
        self.clients.append(client)
        sock.sendall(b"idle\n" if kind == "idle" else b"stream\n")
        if kind == "stalled":
            sock.recv(64)
        elif kind in ("healthy", "slow"):
            client.reader = threading.Thread(target=client._read_loop, daemon=True)
            client.reader.start()
        return client

    def wait_for_server_sockets(self, count: int, timeout_seconds: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while len(self.server_sockets) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.server_sockets)} of {count} accepted")
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        for client in self.clients:
            client.stop.set()
        for sock in [*self.server_sockets, *(c.sock for c in self.clients), self.listener]:
            abort(sock)
        for thread in [self._accepting, *self._threads]:
            thread.join(timeout=2)
        for client in self.clients:
            if client.reader is not None:
                client.reader.join(timeout=2)

    def __enter__(self) -> Scenario:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
