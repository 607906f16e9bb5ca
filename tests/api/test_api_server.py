"""ApiServer's budgets and replies: a full connection table closes its oldest connection, a
request that never completes is closed, and JSON replies encode whatever an engine sent."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from kvwatch.api import api_server
from kvwatch.api.api_server import ApiServer
from kvwatch.api.routes import JSONResponse
from kvwatch.daemon.logrepeat import RepeatFilter
from kvwatch.daemon.preflight import bind_listen_address
from tests.hookserver.conftest import run_async, wait_until


async def _hello(_: Request) -> JSONResponse:
    return JSONResponse({"engine": "\ud800-engine", "ok": True})


def _app() -> Starlette:
    return Starlette(routes=[Route("/hello", _hello)])


async def _idle(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def test_a_full_table_closes_the_oldest_and_answers_the_newest() -> None:
    async def scenario() -> None:
        server = ApiServer(_app(), bind_listen_address("127.0.0.1:0"), max_connections=4)
        await server.start()
        port = server.address[1]
        try:
            idle = [await _idle(port) for _ in range(20)]
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{port}/hello", timeout=5.0)
            assert answer.status_code == 200
            assert server.connection_count() <= 4
            assert server.connections_dropped >= 16
            assert await asyncio.wait_for(idle[0][0].read(), 5.0) == b""  # the oldest: cut
            for _, writer in idle:
                writer.close()
        finally:
            await server.close()

    run_async(scenario())


def test_a_request_that_never_completes_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_server, "REQUEST_SECONDS", 0.3)
    monkeypatch.setattr(api_server, "SWEEP_SECONDS", 0.05)

    async def scenario() -> None:
        server = ApiServer(_app(), bind_listen_address("127.0.0.1:0"))
        await server.start()
        try:
            reader, writer = await _idle(server.address[1])
            writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            assert await asyncio.wait_for(reader.read(), 5.0) == b""
            await wait_until(lambda: server.connection_count() == 0)
            writer.close()
        finally:
            await server.close()

    run_async(scenario())


def test_json_replies_encode_strings_that_are_not_text() -> None:
    body = bytes(JSONResponse({"engine": "a\ud800b", "n": 1}).body)
    assert json.loads(body) == {"engine": "a?b", "n": 1}


def test_repeated_log_lines_pass_once_per_window(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kvwatch.test.repeat")
    repeat = RepeatFilter(window_seconds=60)
    logger.addFilter(repeat)
    try:
        with caplog.at_level(logging.INFO, logger="kvwatch.test.repeat"):
            for index in range(10_000):
                logger.warning("connection %d refused", index)
            logger.warning("another kind")
            repeat.window_seconds = 0
            logger.warning("connection %d refused", 10_000)
    finally:
        logger.removeFilter(repeat)
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "connection 0 refused",
        "another kind",
        "connection 10000 refused [and 9999 more like it since the last one logged]",
    ]
