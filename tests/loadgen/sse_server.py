"""A small real OpenAI-style streaming server for the load generator tests.

Plain asyncio streams on a loopback port, in a thread with its own event loop, so a test can
make it reset connections (SO_LINGER 0 + close sends an RST) and see blocked writes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

STARTUP_SECONDS = 5.0


@dataclass
class Behaviour:
    """How the server answers streaming requests."""

    tokens: int = 10
    token_delay_seconds: float = 0.02
    padding_bytes: int = 0  # extra bytes in each chunk, to fill socket buffers sooner
    reset_after_tokens: int | None = None  # RST right after this many tokens
    reset_after_seconds: float | None = None  # RST this long after the request, reading or not
    end_after_tokens: int | None = None  # end the body cleanly after this many, without [DONE]
    status: int = 200
    sndbuf_bytes: int = 0  # SO_SNDBUF of streaming connections (0: the kernel's autotuning)


@dataclass
class Seen:
    requests: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


class SseServer:
    """Serves GET /v1/models and POST /v1/completions, /v1/chat/completions (streaming)."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.seen = Seen()
        self.writers: list[asyncio.StreamWriter] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-sse-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SseServer:
        self._thread.start()
        if not self._ready.wait(STARTUP_SECONDS):
            raise RuntimeError("the test SSE server did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STARTUP_SECONDS)

    def blocked_writers(self) -> int:
        """Connections whose server-side write buffer is not empty (the peer is not reading)."""
        return sum(
            1
            for w in list(self.writers)
            if not w.is_closing() and w.transport.get_write_buffer_size() > 0
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in self.writers:
                writer.transport.abort()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            method, path, _ = head.split(" ", 2)
            length = next(
                (int(line.split(":")[1]) for line in head.split("\r\n")
                 if line.lower().startswith("content-length:")),
                0,
            )  # fmt: skip
            body = json.loads(await reader.readexactly(length)) if length else {}
            self.seen.paths.append(f"{method} {path}")
            if path == "/v1/models":
                await _send_json(writer, 200, {"object": "list", "data": [{"id": "test-model"}]})
            elif path in ("/v1/completions", "/v1/chat/completions"):
                self.seen.requests.append(body)
                await self._stream(writer, chat=path.endswith("chat/completions"))
            else:
                await _send_json(writer, 404, {"error": {"message": f"no route {path}"}})
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a client that went away, or the server stopping
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, chat: bool) -> None:
        b = self.behaviour
        if b.status != 200:
            await _send_json(writer, b.status, {"error": {"message": "model overloaded"}})
            return
        if b.sndbuf_bytes:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, b.sndbuf_bytes)
        if b.reset_after_seconds is not None:
            asyncio.get_running_loop().call_later(b.reset_after_seconds, _reset, writer)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for index in range(b.tokens):
            await asyncio.sleep(b.token_delay_seconds)
            last = index == b.tokens - 1
            _write_chunk(writer, _event(index, chat, "length" if last else None, b.padding_bytes))
            await writer.drain()
            if b.reset_after_tokens is not None and index + 1 >= b.reset_after_tokens:
                _reset(writer)
                return
            if b.end_after_tokens is not None and index + 1 >= b.end_after_tokens:
                break
        else:
            _write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _event(index: int, chat: bool, finish_reason: str | None, padding_bytes: int) -> bytes:
    text = f" t{index}"
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    chunk = {"id": "cmpl-test", "choices": [choice], "pad": "x" * padding_bytes}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def _send_json(writer: asyncio.StreamWriter, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Ends the connection with an RST, like an engine cancelling a stalled stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None and not writer.is_closing():
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
