"""Fixtures of the engine tests: real engines, real HTTP servers on loopback, raw-socket clients.

Every engine here is the tiny model on the CPU; every server listens on a free loopback port
and is stopped (engine included) when its test ends.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwatch.engine.config import EngineConfig
from kvwatch.engine.engine import Engine
from kvwatch.engine.engine_server import EngineServer

STALLED_RCVBUF_BYTES = 4096


def tiny_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {"model_size": "tiny", "device": "cpu", "kv_blocks": 256}
    settings.update(overrides)
    return EngineConfig(**settings)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Builds started engines (tiny model, CPU) and stops them after the test."""
    engines: list[Engine] = []

    def make(**overrides: Any) -> Engine:
        engine = Engine(tiny_config(**overrides))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., EngineServer]]:
    """Builds HTTP servers over fresh engines on free loopback ports; stops them after."""
    servers: list[EngineServer] = []

    def make(sndbuf_bytes: int = 4096, **overrides: Any) -> EngineServer:
        server = EngineServer(
            Engine(tiny_config(**overrides)), "127.0.0.1", 0, sndbuf_bytes=sndbuf_bytes
        )
        server.start_in_thread()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


class StalledClient:
    """A client that sends a streaming request, reads the first bytes, then stops reading
    while keeping the connection open. Its receive buffer is set small before connect, so the
    window it advertises closes quickly."""

    def __init__(
        self, address: tuple[str, int], body: bytes, request_id: str, extra_headers: str = ""
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RCVBUF_BYTES)
        self.sock.settimeout(20.0)
        self.sock.connect(address)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"X-Request-Id: {request_id}\r\n{extra_headers}\r\n"
        )
        self.sock.sendall(head.encode() + body)
        self.received = b""
        while b"data: " not in self.received:
            chunk = self.sock.recv(1024)
            if not chunk:
                raise AssertionError(f"server closed early: {self.received!r}")
            self.received += chunk

    def drain_until_closed(self) -> str:
        """Reads everything left; returns "reset" on ECONNRESET, "eof" on an orderly close."""
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            return "reset"
        return "eof"

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stalled_clients() -> Iterator[list[StalledClient]]:
    """A list the test appends its stalled clients to; all are closed after the test."""
    clients: list[StalledClient] = []
    yield clients
    for client in clients:
        client.close()
