"""A small real agent for the hook tests: a unix-socket server speaking
kvwatch.hookwire.protocol."""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvwatch.errors import ProtocolError
from kvwatch.hook import EngineInfo
from kvwatch.hookwire.protocol import LineFramer, Message, encode
from kvwatch.lab import waiting

WAIT_SECONDS = 5.0
M = TypeVar("M", bound=Message)
ENGINE_INFO = EngineInfo(
    engine="kvwatch-reference",
    model="tiny",
    pid=4242,
    bytes_per_block=16384,
    device="cpu",
    kv_blocks_total=128,
)


class AgentServer:
    """Listens on `path`, accepts hooks, records what they send, sends what a test asks.

    Runs one selector thread. With `reading=False` it accepts connections but never reads
    them, like a stuck agent; `resume_reading()` starts reading them.
    """

    def __init__(self, path: str, *, reading: bool = True) -> None:
        self.path = path
        self.messages: list[Message] = []
        self.errors: list[ProtocolError] = []
        self.connections: list[socket.socket] = []
        self.closed_by_peer = 0
        self._reading = reading
        self._framers: dict[socket.socket, LineFramer] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(16)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="test-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_SECONDS)
        self._selector.close()
        for conn in [self._listener, *self.connections]:
            conn.close()
        Path(self.path).unlink(missing_ok=True)

    def resume_reading(self) -> None:
        self._reading = True

    def send(self, data: Message | bytes) -> None:
        """Sends to the newest connection (waiting for the first one to be accepted)."""
        wait_until(lambda: bool(self.connections))
        self.connections[-1].sendall(encode(data) if isinstance(data, Message) else data)

    def wait_for(
        self, predicate: Callable[[list[Message]], bool], timeout: float = WAIT_SECONDS
    ) -> list[Message]:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.messages), timeout):
                raise AssertionError(f"agent never saw the expected messages: {self.messages}")
            return list(self.messages)

    def first(self, kind: type[M], request_id: str, timeout: float = 15.0) -> M:
        """The first `kind` message about `request_id`, waiting for it."""
        messages = self.wait_for(lambda ms: bool(of_kind(ms, kind, request_id)), timeout)
        return of_kind(messages, kind, request_id)[0]

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    self._read(key.fileobj)
            if self._reading:
                for conn in self.connections:
                    if conn not in self._framers and conn.fileno() >= 0:
                        self._framers[conn] = LineFramer(sender="engine")
                        self._selector.register(conn, selectors.EVENT_READ)

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        self.connections.append(conn)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(conn)
            self.closed_by_peer += 1
            return
        with self._cond:
            for item in self._framers[conn].feed(data):
                if isinstance(item, ProtocolError):
                    self.errors.append(item)
                else:
                    self.messages.append(item)
            self._cond.notify_all()


def of_kind(messages: list[Message], kind: type[M], request_id: str | None = None) -> list[M]:
    """The messages of `kind` (about `request_id`, if given), in order."""
    return [
        m
        for m in messages
        if isinstance(m, kind) and request_id in (None, getattr(m, "request_id", None))
    ]


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_SECONDS) -> None:
    """kvwatch.lab.waiting.wait_until with these tests' default timeout, looking every 10 ms."""
    waiting.wait_until(predicate, timeout, poll_seconds=0.01)
