"""Parking over the wire: a real client over TCP stops reading (small receive buffer), the
request is parked (through the engine hook from a test agent, or by `Engine.park`) and
released, and once the client reads again it gets the whole stream: every token, `[DONE]`,
the same text as an unparked request. An engine with parking off does not offer it in its
hello.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvwatch.hookwire.protocol import (
    FEATURE_PARK,
    FEATURE_PAUSE,
    Close,
    EngineInfo,
    Park,
    Parked,
    Release,
    Released,
    Resumed,
    Update,
)
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.engine_server import EngineServer, attach_hook
from kvwatch.lab.waiting import wait_until
from tests.engine.conftest import MiniAgent, StalledClient, completion_text, tiny_config

pytestmark = pytest.mark.engine

PROMPT = "park me"
MAX_TOKENS = 400  # well past what the socket buffers take: the request blocks on its client


def stall(server: EngineServer, clients: list[StalledClient], name: str) -> StalledClient:
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True})
    client = StalledClient(server.address, body.encode(), request_id=name)
    clients.append(client)
    return client


def holding_blocks(engine: Engine, request_id: str) -> None:
    wait_until(
        lambda: any(r.request_id == request_id and r.kv_blocks for r in engine.stats().requests),
        20,
        f"{request_id} holding blocks",
    )


def unparked_text(server: EngineServer) -> str:
    return completion_text(server, PROMPT, MAX_TOKENS)


def test_a_client_that_stops_reading_is_parked_released_and_gets_the_whole_stream(
    make_server: Callable[..., EngineServer], stalled_clients: list[StalledClient]
) -> None:
    server = make_server(kv_blocks=64, debug_checks=True)
    engine = server.engine
    client = stall(server, stalled_clients, "http")
    holding_blocks(engine, "cmpl-http")

    assert engine.park("cmpl-http", "test").status == "parked"  # its writer need not be held
    assert engine.stats().kv_blocks_used == 0
    assert engine.release("cmpl-http", "test").status == "released"

    texts = client.read_to_the_end()
    assert len(texts) == MAX_TOKENS
    assert "".join(texts) == unparked_text(server)
    stats = engine.stats()
    assert (stats.num_parks, stats.num_resumes, stats.parked_host_bytes) == (1, 1, 0)


def test_a_park_and_a_release_through_the_engine_hook(
    hooked_server: tuple[EngineServer, MiniAgent], stalled_clients: list[StalledClient]
) -> None:
    server, agent = hooked_server
    hello = agent.wait_for(lambda m: isinstance(m, EngineInfo), "hello")
    assert isinstance(hello, EngineInfo) and hello.can(FEATURE_PARK) and hello.can(FEATURE_PAUSE)
    client = stall(server, stalled_clients, "hooked")
    holding_blocks(server.engine, "cmpl-hooked")

    agent.send(Park(request_id="cmpl-hooked", reason="test", correlation_id="p-1", lease_ms=60000))
    parked = agent.wait_for(lambda m: isinstance(m, Parked), "parked")
    assert isinstance(parked, Parked) and parked.status == "parked" and parked.freed_blocks > 0
    agent.wait_for(lambda m: isinstance(m, Update) and m.kv_blocks == 0, "an update of 0 blocks")
    assert server.engine.stats().kv_blocks_used == 0

    agent.send(Release(request_id="cmpl-hooked", reason="test", correlation_id="r-1"))
    released = agent.wait_for(lambda m: isinstance(m, Released), "released")
    assert isinstance(released, Released) and released.status == "released"
    texts = client.read_to_the_end()

    resumed = agent.wait_for(lambda m: isinstance(m, Resumed), "resumed")
    assert isinstance(resumed, Resumed)
    assert resumed.request_id == "cmpl-hooked"
    assert resumed.kv_blocks > 0 and resumed.recomputed_tokens == 0
    closed = agent.wait_for(lambda m: isinstance(m, Close), "close")
    assert isinstance(closed, Close) and closed.reason == "finished"
    assert len(texts) == MAX_TOKENS
    assert "".join(texts) == unparked_text(server)


def test_an_engine_with_parking_and_pausing_off_offers_neither(tmp_path: Path) -> None:
    agent = MiniAgent(tmp_path / "engine.sock")
    engine = Engine(tiny_config(park=False, pause=False))
    hook = attach_hook(engine, str(tmp_path / "engine.sock"))
    hook.start()
    try:
        hello = agent.wait_for(lambda m: isinstance(m, EngineInfo), "hello")
        assert isinstance(hello, EngineInfo)
        assert not hello.can(FEATURE_PARK) and not hello.can(FEATURE_PAUSE)
    finally:
        hook.stop()
        agent.close()
