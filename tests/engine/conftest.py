"""Fixtures of the engine tests: real engines, real HTTP servers on loopback, raw-socket clients,
and a minimal agent on the engine hook's unix socket.

Every engine here is the tiny model on the CPU; every server listens on a free loopback port
and is stopped (engine included) when its test ends.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.hookwire.protocol import LineFramer, Message, encode
from kvwatch.lab.engine.config import EngineConfig
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.engine_server import EngineServer, attach_hook
from kvwatch.lab.engine.parking import CopyOut

STALLED_RCVBUF_BYTES = 4096
AGENT_WAIT_SECONDS = 10.0


def tiny_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {"model_size": "tiny", "device": "cpu", "kv_blocks": 256}
    settings.update(overrides)
    return EngineConfig(**settings)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Builds started engines (tiny model, CPU; `copy_out` as `Engine` takes it) and stops
    them after the test."""
    engines: list[Engine] = []

    def make(copy_out: CopyOut | None = None, **overrides: Any) -> Engine:
        engine = Engine(tiny_config(**overrides), copy_out=copy_out)
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

    def read_to_the_end(self) -> list[str]:
        """Reads the rest of the stream; the text of each token event, once [DONE] came."""
        data = self.received
        while b"data: [DONE]" not in data:
            chunk = self.sock.recv(65536)
            assert chunk, f"the stream ended before [DONE]: {data[-200:]!r}"
            data += chunk
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: {")]
        choices = [json.loads(event)["choices"][0] for event in events]
        assert choices[-1]["finish_reason"] == "length"
        return [choice["text"] for choice in choices[:-1]]

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


def completion_text(server: EngineServer, prompt: str, max_tokens: int) -> str:
    """The text of a plain (unstreamed) completion: what any stream of it must carry."""
    body = {"prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    text: str = response.json()["choices"][0]["text"]
    return text


@pytest.fixture
def stalled_clients() -> Iterator[list[StalledClient]]:
    """A list the test appends its stalled clients to; all are closed after the test."""
    clients: list[StalledClient] = []
    yield clients
    for client in clients:
        client.close()


class MiniAgent:
    """Accepts one hook connection, records its messages, sends what the test asks."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.conn: socket.socket | None = None
        self.messages: list[Message] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.conn = conn
        framer = LineFramer(sender="engine")
        while data := conn.recv(65536):  # a reset by the hook ends the test agent too
            with self._cond:
                self.messages.extend(m for m in framer.feed(data) if isinstance(m, Message))
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Message], bool], what: str) -> Message:
        with self._cond:
            seen = self._cond.wait_for(
                lambda: any(predicate(m) for m in self.messages), AGENT_WAIT_SECONDS
            )
            assert seen, f"agent never got {what}; it got {self.messages}"
            return next(m for m in reversed(self.messages) if predicate(m))

    def send(self, message: Message) -> None:
        assert self.conn is not None
        self.conn.sendall(encode(message))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.shutdown(socket.SHUT_RDWR)
            self.conn.close()
        self.listener.close()
        self._thread.join(AGENT_WAIT_SECONDS)


@pytest.fixture
def hooked_server(tmp_path: Path) -> Iterator[tuple[EngineServer, MiniAgent]]:
    """A coupled engine (64 blocks) served over HTTP, its hook on a test agent's socket."""
    agent = MiniAgent(tmp_path / "engine.sock")
    engine = Engine(tiny_config(kv_blocks=64, egress="coupled"))
    server = EngineServer(
        engine,
        "127.0.0.1",
        0,
        sndbuf_bytes=4096,
        hook=attach_hook(engine, str(tmp_path / "engine.sock")),
    )
    server.start_in_thread()
    yield server, agent
    server.stop()
    agent.close()
