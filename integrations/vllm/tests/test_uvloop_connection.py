"""The hook finds the connection under uvloop, the event loop vLLM's server runs uvicorn on:
uvloop's transports do not derive from asyncio.BaseTransport, so the middleware's
`find_connection` must take them by their methods (kvwatch.hook.asgi_conn). Without the
transport, a stream is announced with the scope's addresses (which proxy headers rewrite) and
a cancel cannot reset its connection: the server closes it gracefully behind the unsent data,
and a client that stopped reading never learns it was cut."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from typing import Any

import uvicorn

from kvwatch.hook.asgi_conn import Connection, find_connection
from tests.support.clients import wait_for

CHUNK = b"data: " + b"x" * 1000 + b"\n\n"


def test_a_connection_under_uvloop_is_found_and_reset() -> None:
    found: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        connection = find_connection(scope)
        found["connection"] = connection
        start = {"type": "http.response.start", "status": 200, "headers": []}
        await send(start)
        for _ in range(400):  # ~400 KB: more than a client that does not read takes
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await asyncio.sleep(0)
        assert isinstance(connection, Connection)
        found["reset"] = connection.reset()

    server = uvicorn.Server(uvicorn.Config(app, port=0, loop="uvloop", log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "uvicorn on uvloop")
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            client.recv(100)  # then reads no more
            wait_for(lambda: "reset" in found, 30, "the app's reset")
            connection = found["connection"]
            assert connection.from_socket and connection.transport is not None
            assert connection.remote == client.getsockname()
            assert found["reset"] is True
            error = wait_for(
                lambda: client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), 5, "the reset"
            )
            assert error == errno.ECONNRESET
    finally:
        server.should_exit = True
        thread.join(10)
