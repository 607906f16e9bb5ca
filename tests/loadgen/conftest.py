"""Fixtures for the load generator tests: real streaming servers on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.loadgen.sse_server import SseServer


@pytest.fixture
def sse_server() -> Iterator[SseServer]:
    server = SseServer().start()
    yield server
    server.stop()


async def _chat(request: Request) -> StreamingResponse:
    body = await request.json()

    async def chunks() -> AsyncIterator[str]:
        yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
        for index in range(body["max_tokens"]):
            await asyncio.sleep(0.01)  # deliberate: a token every 10 ms, as a model streams
            delta = {"content": f" w{index}"}
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"
        yield 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
        yield "data: [DONE]\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "starlette-model"}]})


@pytest.fixture
def starlette_url() -> Iterator[str]:
    """A Starlette app on uvicorn, the stack real engines use, on a free port."""
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _chat, methods=["POST"]),
            Route("/v1/models", _models),
        ]
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()
