"""Real loopback TCP connections for the sock_diag tests, closed at teardown."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from kvwatch.collect.diag import DiagClient, DiagEntry
from kvwatch.sockets import Endpoint

SO_COOKIE = getattr(socket, "SO_COOKIE", 57)
SMALL_RCVBUF_BYTES = 4096


@dataclass
class TcpPair:
    """A listener, the server side of one accepted connection, and its client."""

    listener: socket.socket
    server: socket.socket
    client: socket.socket
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def server_local(self) -> Endpoint:
        host, port = self.server.getsockname()[:2]
        return Endpoint.parse(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    @property
    def server_remote(self) -> Endpoint:
        host, port = self.server.getpeername()[:2]
        return Endpoint.parse(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    @property
    def port(self) -> int:
        port: int = self.listener.getsockname()[1]
        return port

    @property
    def server_cookie(self) -> int:
        cookie: int = struct.unpack("=Q", self.server.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[
            0
        ]
        return cookie

    def fill(self) -> int:
        """Writes from the server (non-blocking) until its send buffer is full; bytes written."""
        self.server.setblocking(False)
        written = 0
        try:
            while True:
                written += self.server.send(b"x" * 65536)
        except BlockingIOError:
            return written

    def close(self) -> None:
        for sock in (self.client, self.server, self.listener):
            sock.close()
        for thread in self.threads:
            thread.join(timeout=5)


PairFactory = Callable[..., TcpPair]


@pytest.fixture
def tcp_pair() -> Iterator[PairFactory]:
    """make(listen_host="127.0.0.1", connect_host=None, client_rcvbuf=None) -> TcpPair."""
    pairs: list[TcpPair] = []

    def make(
        listen_host: str = "127.0.0.1",
        connect_host: str | None = None,
        client_rcvbuf: int | None = None,
    ) -> TcpPair:
        family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind((listen_host, 0))
        listener.listen()
        target = connect_host or listen_host
        client = socket.socket(socket.AF_INET6 if ":" in target else socket.AF_INET)
        if client_rcvbuf is not None:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, client_rcvbuf)
        client.connect((target, listener.getsockname()[1]))
        server, _ = listener.accept()
        pair = TcpPair(listener, server, client)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


@pytest.fixture
def diag_client() -> Iterator[DiagClient]:
    with DiagClient() as client:
        yield client


def find_entry(client: DiagClient, pair: TcpPair) -> DiagEntry | None:
    """The server side of `pair` in a fresh snapshot filtered by its port."""
    for entry in client.snapshot(local_ports=[pair.port]).entries:
        if entry.cookie == pair.server_cookie:
            return entry
    return None


def wait_for_entry(
    client: DiagClient,
    pair: TcpPair,
    predicate: Callable[[DiagEntry], bool],
    timeout_seconds: float = 1.0,
) -> DiagEntry:
    """Polls every 20 ms until the server side of `pair` satisfies `predicate`."""
    deadline = time.monotonic() + timeout_seconds
    last: DiagEntry | None = None
    while time.monotonic() < deadline:
        last = find_entry(client, pair)
        if last is not None and predicate(last):
            return last
        time.sleep(0.02)
    raise AssertionError(f"no snapshot satisfied the condition in {timeout_seconds} s: {last}")
