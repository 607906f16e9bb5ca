"""Stream clients as the world has them: receive buffers from 4 KB to the kernel's default
and autotuned, readers that keep up, readers slower than the writer, readers that stop.
Each runs on its own thread and records what happened to its connection."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from kvwatch.lab.harness.scenario import abort

# What sets the client's receive buffer: a fixed SO_RCVBUF, or the kernel's default
# (tcp_rmem[1]) with autotuning, either read slowly from the start or after a fast phase
# that lets autotuning grow the buffer.
Buffer = Literal["4k", "64k", "default", "autotuned"]
AUTOTUNE_SECONDS = 3.0
READ_QUANTUM_BYTES = 1024
TICK_SECONDS = 0.02


def _unread_bytes(sock: socket.socket) -> int:
    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    count: int = struct.unpack("i", raw)[0]
    return count


@dataclass
class Reader:
    """One client. `rate` is what it drains, bytes per second, while it reads; it stops
    reading for good after `read_seconds` (None: never; 0: right after the first bytes).
    The server's orderly close counts as a reset (the token server never closes), unless
    `eof_ends` (an HTTP response that ends): then it sets `ended_ns`. With `half_close` it
    shuts its sending side after the request (the server's socket is then in CLOSE_WAIT).
    With `pause_after`, it stops reading that many seconds in, for `pause_seconds`, then
    reads as fast as it can (someone who switched tabs and came back); `paused_ns` and
    `paused_at_bytes` say when it stopped and what it had read by then."""

    name: str
    buffer: Buffer
    rate: int
    read_seconds: float | None = None
    sock: socket.socket | None = None
    local: str = ""
    bytes_read: int = 0
    max_unread: int = 0
    stopped_ns: int = 0
    reset_ns: int = 0
    eof_ends: bool = False
    half_close: bool = False
    pause_after: float | None = None
    pause_seconds: float = 0.0
    paused_ns: int = 0
    paused_at_bytes: int = 0
    ended_ns: int = 0
    received: bytearray = field(default_factory=bytearray)
    stop: threading.Event = field(default_factory=threading.Event)
    _pause_over: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def live(self) -> bool:
        return self.read_seconds is None

    def connect(
        self, sock: socket.socket, host: str, port: int, request: bytes = b"stream\n"
    ) -> None:
        """Connects, sends `request` (the token server's; an HTTP request for a real server)
        and starts reading on the reader's thread."""
        if self.buffer in ("4k", "64k"):
            size = 4096 if self.buffer == "4k" else 65536
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        sock.connect((host, port))
        sock.sendall(request)
        if self.half_close:
            sock.shutdown(socket.SHUT_WR)
        self.sock = sock
        self.local = "{}:{}".format(*sock.getsockname()[:2])
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(TICK_SECONDS)
        try:
            self._read()
            if self.ended_ns:
                return
            self.stopped_ns = time.monotonic_ns()
            self._hold()
        except OSError as exc:
            if exc.errno in (errno.ECONNRESET, errno.EPIPE) or isinstance(exc, ConnectionError):
                self.reset_ns = time.monotonic_ns()

    def _read(self) -> None:
        """Reads at `rate` (after the autotuning phase) until `read_seconds` have passed."""
        assert self.sock is not None
        start = time.monotonic()
        if self.read_seconds == 0:
            self.sock.settimeout(None)
            self._took(self.sock.recv(200))
            self.sock.settimeout(TICK_SECONDS)
            return
        fast_until = start + AUTOTUNE_SECONDS if self.buffer == "autotuned" else start
        phase_start, phase_bytes = fast_until, 0
        while not self.stop.is_set():
            now = time.monotonic()
            if self.read_seconds is not None and now - start >= self.read_seconds:
                return
            if self.pause_after is not None and now - start >= self.pause_after:
                self.pause_after = None
                self.paused_ns, self.paused_at_bytes = time.monotonic_ns(), self.bytes_read
                self._pause_over.wait(self.pause_seconds)
                if self.stop.is_set():
                    return
                self.rate, phase_start, phase_bytes = 1 << 24, time.monotonic(), 0
                continue
            self.max_unread = max(self.max_unread, _unread_bytes(self.sock))
            allowed = 1 << 16 if now < fast_until else int(self.rate * (now - phase_start))
            want = min(allowed - phase_bytes, READ_QUANTUM_BYTES if now >= fast_until else 1 << 16)
            if want <= 0:
                time.sleep(TICK_SECONDS)
                continue
            with contextlib.suppress(TimeoutError):
                data = self.sock.recv(want)
                if not data and self.eof_ends:
                    self.ended_ns = time.monotonic_ns()
                    return
                if not data:
                    raise ConnectionResetError("the server closed the stream")
                self._took(data)
                if now >= fast_until:
                    phase_bytes += len(data)

    def _took(self, data: bytes) -> None:
        self.bytes_read += len(data)
        if self.eof_ends:
            self.received += data

    def _hold(self) -> None:
        """Keeps the connection open without reading; notices a reset."""
        assert self.sock is not None
        while not self.stop.wait(0.05):
            if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.reset_ns = time.monotonic_ns()
                return

    def stop_pause(self) -> None:
        """Ends a pause now: the reader reads again, as fast as it can."""
        self._pause_over.set()

    def close(self) -> None:
        self.stop.set()
        self._pause_over.set()
        if self.thread is not None:
            self.thread.join(timeout=2)
        if self.sock is not None:
            abort(self.sock)
