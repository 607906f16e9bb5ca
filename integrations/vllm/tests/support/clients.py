"""Streaming clients as the agent meets them: a raw TCP socket with the kernel's default receive
buffer (no SO_RCVBUF), read on a thread of its own at a given pace — as fast as bytes come, a
fixed rate, or until a moment and then not at all (until told to read again, or never) — and
what it received, parsed into vLLM's completion chunks."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

READ_QUANTUM_BYTES = 1024
TICK_SECONDS = 0.02
T = TypeVar("T")


def wait_for(produce: Callable[[], T | None], timeout_seconds: float, what: str) -> T:
    """What `produce` returns once it is truthy; an AssertionError naming `what` after
    `timeout_seconds`."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = produce()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds:g} s waiting for {what}")
        time.sleep(0.05)


@dataclass(frozen=True)
class Completion:
    """A streamed completion as the client got it: the token ids of its chunks in order,
    the last finish reason, whether `data: [DONE]` ended it, and how many data events."""

    token_ids: list[int]
    finish_reason: str | None
    done: bool
    events: int


def parse_completion(raw: bytes) -> Completion:
    """The HTTP/1.1 response (chunked transfer coding) of a streaming /v1/completions."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        assert rest[size : size + 2] == b"\r\n", "a chunk without its CRLF"
        rest = rest[size + 2 :]
    token_ids: list[int] = []
    finish_reason, done, events = None, False, 0
    for event in bytes(body).split(b"\n\n"):
        if not event.startswith(b"data: "):
            assert not event.strip(), f"not an SSE data event: {event[:200]!r}"
            continue
        data = event[len(b"data: ") :]
        events += 1
        if data == b"[DONE]":
            done = True
            continue
        choice = json.loads(data)["choices"][0]
        token_ids += choice.get("token_ids") or []
        finish_reason = choice.get("finish_reason") or finish_reason
    return Completion(token_ids, finish_reason, done, events)


@dataclass
class Client:
    """One streaming completion. `rate`: bytes per second the client drains (None: all that
    arrives); `stop_after`: seconds after its first bytes at which it stops reading (None:
    never) until `read_again()`, then as fast as bytes come. `stopped_ns`, `received` and
    `reset_ns` / `ended_ns` (monotonic) say what happened to it."""

    request_id: str
    rate: int | None = None
    stop_after: float | None = None
    received: bytearray = field(default_factory=bytearray)
    first_bytes_ns: int = 0
    stopped_ns: int = 0
    stopped_at_bytes: int = 0
    ended_ns: int = 0
    reset_ns: int = 0
    error: str = ""
    sock: socket.socket | None = None
    _read_again: threading.Event = field(default_factory=threading.Event)
    _closing: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(
        self, sock: socket.socket, host: str, port: int, prompt: list[int], max_tokens: int
    ) -> Client:
        """Sends the request on `sock` (unconnected: the caller makes it where the client
        lives) to `host`:`port` and starts reading on the client's thread."""
        payload = json.dumps(
            {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "stream": True,
                "return_token_ids": True,
                "ignore_eos": True,
            }
        ).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nX-Request-Id: {self.request_id}\r\n"
            f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        sock.connect((host, port))
        sock.sendall(request)
        self.sock = sock
        self._thread = threading.Thread(target=self._run, name=self.request_id, daemon=True)
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return bool(self.ended_ns or self.reset_ns or self.error)

    def completion(self) -> Completion:
        return parse_completion(bytes(self.received))

    def read_again(self) -> None:
        self._read_again.set()

    def close(self) -> None:
        self._closing.set()
        self._read_again.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.sock is not None:
            self.sock.close()

    def _run(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(TICK_SECONDS)
        try:
            self._read()
        except OSError as exc:
            if isinstance(exc, ConnectionError) or exc.errno in (errno.ECONNRESET, errno.EPIPE):
                self.reset_ns = time.monotonic_ns()
            else:
                self.error = repr(exc)

    def _read(self) -> None:
        assert self.sock is not None
        phase_start, phase_bytes = 0.0, 0
        while not self._closing.is_set():
            now = time.monotonic()
            if self.first_bytes_ns and self._stop_due(now):
                self._stop()
                phase_start, phase_bytes = time.monotonic(), 0
                continue
            want = 1 << 16
            if self.rate is not None and self.first_bytes_ns:
                want = min(int(self.rate * (now - phase_start)) - phase_bytes, READ_QUANTUM_BYTES)
                if want <= 0:
                    time.sleep(TICK_SECONDS)
                    continue
            try:
                data = self.sock.recv(want)
            except TimeoutError:
                continue
            if not data:
                self.ended_ns = time.monotonic_ns()
                return
            if not self.first_bytes_ns:
                self.first_bytes_ns, phase_start = time.monotonic_ns(), time.monotonic()
            self.received += data
            phase_bytes += len(data)

    def _stop_due(self, now: float) -> bool:
        return (
            self.stop_after is not None
            and not self.stopped_ns
            and now - self.first_bytes_ns / 1e9 >= self.stop_after
        )

    def _stop(self) -> None:
        """Reads nothing until told to read again; a reset shows on the socket meanwhile."""
        assert self.sock is not None
        self.stopped_ns, self.stopped_at_bytes = time.monotonic_ns(), len(self.received)
        while not self._read_again.wait(0.05):
            if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.reset_ns = time.monotonic_ns()
                raise ConnectionResetError("reset while not reading")
        self.rate = None
