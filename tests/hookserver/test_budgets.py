"""The hook server's budgets (issue #13): silent connections cannot lock engines out, one uid
cannot take every slot, an engine cannot make the agent hold unbounded streams, and running
out of descriptors slows accepting down instead of spinning."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket

import pytest

from kvwatch import accept
from kvwatch.accept import AcceptLoop
from kvwatch.hookserver.registry import COUNTER_NAMES, EngineStream, StreamRegistry
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import EngineInfo, ErrorMessage, Welcome
from kvwatch.sockets import Endpoint
from tests.hookserver.conftest import RawEngine, engine_hook, run_async, running_server, wait_until

HELLO = EngineInfo(
    engine="raw", model="tiny", pid=os.getpid(), bytes_per_block=1, device="cpu", kv_blocks_total=1
)


def test_a_connection_that_says_no_hello_is_closed(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path, hello_seconds=0.3) as (server, _):
            silent = await RawEngine.connect(socket_path)
            engine = await RawEngine.connect(socket_path)
            await engine.send(HELLO)
            assert isinstance(await engine.receive(), Welcome)
            assert await silent.at_eof(timeout_seconds=2.0)
            # deliberate: past the engine's own hello deadline too (it said hello: kept)
            await asyncio.sleep(0.4)
            assert server.counters()["hello_timeouts"] == 1
            assert [e["engine"] for e in server.engines()] == ["raw"]  # the session stays
            await engine.close()

    run_async(scenario())


def test_silent_connections_make_room_for_an_engine(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path, max_connections=16, hello_seconds=60) as (
            server,
            _,
        ):
            silent = [await RawEngine.connect(socket_path) for _ in range(256)]
            await wait_until(lambda: server.counters()["connections_accepted"] == 256)
            assert server.connection_count() == 8  # one uid gets half the connections
            async with engine_hook(socket_path) as hook:
                await wait_until(lambda: len(server.engines()) == 1)
                assert hook.connected
            counters = server.counters()
            assert counters["silent_connections_dropped"] >= 240
            assert counters["connections_refused_busy"] == 0
            for connection in silent:
                await connection.close()

    run_async(scenario())


def test_one_uid_gets_at_most_its_share_of_sessions(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path, max_connections_per_uid=2) as (server, _):
            sessions = []
            for _ in range(2):
                engine = await RawEngine.connect(socket_path)
                await engine.send(HELLO)
                assert isinstance(await engine.receive(), Welcome)
                sessions.append(engine)
            third = await RawEngine.connect(socket_path)
            refusal = await third.receive()
            assert isinstance(refusal, ErrorMessage)
            assert f"uid {os.geteuid()} already has 2 engine connections" in refusal.message
            assert refusal.hint
            assert server.counters()["connections_refused_busy"] == 1
            for engine in sessions:
                await engine.close()

    run_async(scenario())


def _stream(request_id: str, port: int) -> EngineStream:
    return EngineStream(
        request_id=request_id,
        engine_pid=1,
        announced_pid=1,
        engine="e",
        model="m",
        device="cpu",
        local=Endpoint("127.0.0.1", 8000),
        remote=Endpoint("127.0.0.1", port),
        kv_blocks=1,
        bytes_per_block=1,
        tokens_out=0,
        opened_ns=0,
    )


def test_streams_are_capped_per_connection_and_in_total() -> None:
    counters = EventCounters(COUNTER_NAMES)
    registry = StreamRegistry(counters, None, max_per_owner=2, max_streams=3)
    assert registry.open(1, _stream("a", 1)) and registry.open(1, _stream("b", 2))
    assert not registry.open(1, _stream("c", 3))  # owner 1 is full
    assert registry.open(1, _stream("a", 4))  # a re-open replaces: no new stream
    assert registry.open(2, _stream("d", 5))
    assert not registry.open(3, _stream("e", 6))  # all owners together are full
    assert len(registry) == 3
    assert counters.snapshot()["streams_refused"] == 2
    registry.forget_owner(1)
    assert registry.open(3, _stream("e", 6))


def test_running_out_of_descriptors_pauses_accepting_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(accept, "BACKOFF_MIN_SECONDS", 0.001)
    monkeypatch.setattr(accept, "BACKOFF_MAX_SECONDS", 0.01)
    failures = 200
    freed: list[int] = []
    handled: list[socket.socket] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0))  # nobody connects to it
        listener.setblocking(False)
        client, peer = socket.socketpair()
        real_accept = loop.sock_accept
        calls = 0

        async def sock_accept(sock: socket.socket) -> tuple[socket.socket, object]:
            nonlocal calls
            calls += 1
            if calls <= failures:
                raise OSError(errno.EMFILE, "Too many open files")
            if calls == failures + 1:
                return client, None
            return await real_accept(sock)

        monkeypatch.setattr(loop, "sock_accept", sock_accept)
        loop_task = AcceptLoop("test", listener, handled.append, lambda: freed.append(1))
        task = asyncio.create_task(loop_task.run())
        await wait_until(lambda: bool(handled), timeout_seconds=30)
        task.cancel()
        assert loop_task.exhausted_total == failures
        listener.close()
        peer.close()

    with caplog.at_level(logging.WARNING, logger="kvwatch.accept"):
        run_async(scenario(), timeout_seconds=60)
    assert len(freed) == failures  # each failure tried to free a descriptor
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages  # one warning per episode, one when it ends
    assert "cannot accept a connection" in messages[0]
    assert "accepting connections again" in messages[1]
    handled[0].close()
