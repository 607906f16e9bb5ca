"""Real ASGI servers for the middleware tests: Starlette SSE apps (one on sse-starlette, with
its pings) under uvicorn or hypercorn, each in its own thread and event loop on a free loopback
port, and raw-socket clients."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.middleware import ProxyFixMiddleware
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from kvwatch.lab.harness.stack import free_port

EVENT_PADDING_BYTES = 900  # about a kilobyte an event: a stalled client's buffers fill fast
START_SECONDS = 10.0


class SseApp:
    """`POST /v1/completions` streams `max_tokens` OpenAI-style chunks, one every `pause`
    seconds; `outcomes` records how each request's generator ended (finished, disconnected),
    `yielded` how many chunks it has yielded."""

    def __init__(self, pause: float = 0.002) -> None:
        self.pause = pause
        self.outcomes: dict[str, str] = {}
        self.yielded: dict[str, int] = {}
        self.scope_clients: dict[str, str] = {}  # the client address the app was told
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/health", self._health),
            ]
        )

    async def _health(self, request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def _completions(self, request: Request) -> StreamingResponse:
        body = await request.json()
        request_id = f"cmpl-{body.get('tag', 'x')}"
        self.scope_clients[request_id] = request.client.host if request.client else ""
        count = int(body.get("max_tokens", 16))
        padding = "x" * int(body.get("pad", EVENT_PADDING_BYTES))
        events = self._events(request_id, count, padding)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, request_id: str, count: int, padding: str) -> AsyncIterator[str]:
        self.outcomes[request_id] = "running"
        try:
            for index in range(count):
                chunk = {
                    "id": request_id,
                    "choices": [{"text": f" t{index}"}],
                    "pad": padding,
                }
                self.yielded[request_id] = index + 1
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(self.pause)
            yield "data: [DONE]\n\n"
            self.outcomes[request_id] = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            self.outcomes[request_id] = "disconnected"
            raise


class PingingSseApp:
    """`POST /v1/completions` answers with sse-starlette's EventSourceResponse, which sends a
    `: ping` comment every `ping` seconds, each line ended by `sep`. Its events first wait for
    `gate`, as a request waits for llama-cpp-python's generation lock, then stream
    `max_tokens` chunks with the engine's random `cmpl-…` id, one every `pause` seconds (pings
    fall between them), and `[DONE]`."""

    def __init__(self, ping: float, pause: float, sep: str) -> None:
        self.ping = ping
        self.pause = pause
        self.sep = sep
        self.gate = threading.Event()
        self.app = Starlette(routes=[Route("/v1/completions", self._completions, methods=["POST"])])

    async def _completions(self, request: Request) -> EventSourceResponse:
        body = await request.json()
        events = self._events(f"cmpl-{uuid.uuid4().hex}", int(body.get("max_tokens", 16)))
        return EventSourceResponse(events, ping=self.ping, sep=self.sep)

    async def _events(self, request_id: str, count: int) -> AsyncIterator[dict[str, str]]:
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        for index in range(count):
            yield {"data": json.dumps({"id": request_id, "choices": [{"text": f" t{index}"}]})}
            await asyncio.sleep(self.pause)
        yield {"data": "[DONE]"}


class ServerThread:
    """One ASGI server on 127.0.0.1:`port` in a daemon thread; `stop` ends it. With
    `proxy_headers`, the server rewrites the scope's client from proxy headers (uvicorn's
    own option; hypercorn's ProxyFixMiddleware, trusting `Forwarded`). With
    `sndbuf`, every connection gets that fixed send buffer (no autotuning)."""

    def __init__(
        self, kind: str, app: Any, *, proxy_headers: bool = False, sndbuf: int | None = None
    ) -> None:
        self.kind = kind
        self.port = free_port()
        self._app = app
        self._proxy_headers = proxy_headers
        self._sndbuf = sndbuf
        self._loop = asyncio.new_event_loop()
        self._shutdown = asyncio.Event()
        self._uvicorn: uvicorn.Server | None = None
        self._thread = threading.Thread(target=self._run, name=f"test-{kind}", daemon=True)
        self._thread.start()
        wait_listening(self.port)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        if self.kind == "uvicorn":
            config = uvicorn.Config(
                self._app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                proxy_headers=self._proxy_headers,
                forwarded_allow_ips="*",
                lifespan="off",
            )
            self._uvicorn = uvicorn.Server(config)
            await self._uvicorn.serve(sockets=[self._listener()] if self._sndbuf else None)
        else:
            app = self._app
            if self._proxy_headers:  # trusts the Forwarded header, as behind a proxy
                app = ProxyFixMiddleware(app, mode="modern", trusted_hops=1)
            hypercorn_config = HypercornConfig()
            hypercorn_config.bind = [f"127.0.0.1:{self.port}"]
            if self._sndbuf:  # hypercorn takes over a bound socket by its descriptor
                hypercorn_config.bind = [f"fd://{self._listener().detach()}"]
            hypercorn_config.loglevel = "WARNING"
            await hypercorn_serve(app, hypercorn_config, shutdown_trigger=self._shutdown.wait)

    def _listener(self) -> socket.socket:
        """A listening socket whose accepted connections inherit its send buffer size."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sndbuf or 0)
        listener.bind(("127.0.0.1", self.port))
        return listener

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        self._loop.call_soon_threadsafe(self._shutdown.set)
        self._thread.join(START_SECONDS)


@contextmanager
def serving(kind: str, app: Any, **options: Any) -> Iterator[ServerThread]:
    server = ServerThread(kind, app, **options)
    try:
        yield server
    finally:
        server.stop()


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def completion_request(
    port: int,
    tag: str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    pad: int = EVENT_PADDING_BYTES,
) -> bytes:
    body = json.dumps({"tag": tag, "max_tokens": max_tokens, "pad": pad}).encode()
    lines = [
        "POST /v1/completions HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def open_client(port: int, request: bytes, *, rcvbuf: int | None = None) -> socket.socket:
    """A raw client that sent `request`; with `rcvbuf`, a small receive buffer (stall it by
    never reading)."""
    client = socket.socket()
    if rcvbuf is not None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client.connect(("127.0.0.1", port))
    client.sendall(request)
    return client


def read_until(
    client: socket.socket, enough: Callable[[bytes], bool], timeout: float = 20.0
) -> bytes:
    """What the client reads until `enough` of it has come."""
    client.settimeout(timeout)
    data = bytearray()
    while not enough(bytes(data)):
        chunk = client.recv(65536)
        if not chunk:
            raise AssertionError(f"the server closed the response early: {bytes(data)!r}")
        data += chunk
    return bytes(data)


def read_all(client: socket.socket, timeout: float = 20.0) -> bytes:
    """Everything until the server ends the response (chunked terminator) or the socket."""
    client.settimeout(timeout)
    data = bytearray()
    while not data.endswith(b"0\r\n\r\n"):
        chunk = client.recv(65536)
        if not chunk:
            break
        data += chunk
    return bytes(data)
