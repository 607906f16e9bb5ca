"""Parking over the wire: a real client over TCP stops reading (small receive buffer), the
request is parked (through the engine hook from a test agent, or by `Engine.park`), and once
the client reads again it gets the whole stream: every token, `[DONE]`, the same text as an
unparked request. An engine with parking off does not offer it in its hello.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvwatch.engine.engine import Engine
from kvwatch.engine.engine_server import EngineServer, attach_hook
from kvwatch.hookwire.protocol import (
    FEATURE_PARK,
    Close,
    EngineInfo,
    Park,
    Parked,
    Resumed,
    Update,
)
from tests.engine.conftest import MiniAgent, StalledClient, tiny_config
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

PROMPT = "park me"
MAX_TOKENS = 400  # well past what the socket buffers take: the request blocks on its client


def stall(server: EngineServer, clients: list[StalledClient], name: str) -> StalledClient:
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True})
    client = StalledClient(server.address, body.encode(), request_id=name)
    clients.append(client)
    return client


def park_when_blocked(engine: Engine, request_id: str, park: Callable[[int], str]) -> None:
    """Parks the request once it is blocked on its client. Bytes still in flight can drain
    into the client's buffers and unblock it briefly, and then the park is declined: so,
    as the agent would after more back-pressure, it tries again. `park(attempt)` parks and
    returns the answer's status."""
    attempts = itertools.count()

    def parked() -> bool:
        mine = [r for r in engine.stats().requests if r.request_id == request_id]
        if not mine or mine[0].state != "egress_blocked":
            return False
        status = park(next(attempts))
        assert status in ("parked", "declined"), status
        return status == "parked"

    wait_for(parked, 20, f"{request_id} parked")


def read_to_the_end(client: StalledClient) -> list[str]:
    """Reads the rest of the stream; the text of each token event, once [DONE] came."""
    data = client.received
    while b"data: [DONE]" not in data:
        chunk = client.sock.recv(65536)
        assert chunk, f"the stream ended before [DONE]: {data[-200:]!r}"
        data += chunk
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: {")]
    choices = [json.loads(event)["choices"][0] for event in events]
    assert choices[-1]["finish_reason"] == "length"
    return [choice["text"] for choice in choices[:-1]]


def unparked_text(server: EngineServer) -> str:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    text: str = response.json()["choices"][0]["text"]
    return text


def test_a_client_that_stops_reading_is_parked_then_gets_the_whole_stream(
    make_server: Callable[..., EngineServer], stalled_clients: list[StalledClient]
) -> None:
    server = make_server(kv_blocks=64, debug_checks=True)
    engine = server.engine
    client = stall(server, stalled_clients, "http")

    park_when_blocked(engine, "cmpl-http", lambda _: engine.park("cmpl-http", "test").status)

    assert engine.stats().kv_blocks_used == 0
    texts = read_to_the_end(client)
    assert len(texts) == MAX_TOKENS
    assert "".join(texts) == unparked_text(server)
    stats = engine.stats()
    assert (stats.num_parks, stats.num_resumes, stats.parked_host_bytes) == (1, 1, 0)


def test_a_park_through_the_engine_hook_answers_parked_and_resumes(
    hooked_server: tuple[EngineServer, MiniAgent], stalled_clients: list[StalledClient]
) -> None:
    server, agent = hooked_server
    hello = agent.wait_for(lambda m: isinstance(m, EngineInfo), "hello")
    assert isinstance(hello, EngineInfo) and hello.can(FEATURE_PARK)
    client = stall(server, stalled_clients, "hooked")
    answers: list[Parked] = []

    def park(attempt: int) -> str:
        correlation_id = f"p-{attempt}"
        agent.send(Park(request_id="cmpl-hooked", reason="test", correlation_id=correlation_id))
        answer = agent.wait_for(
            lambda m: isinstance(m, Parked) and m.correlation_id == correlation_id, "parked"
        )
        assert isinstance(answer, Parked)
        answers.append(answer)
        return answer.status

    park_when_blocked(server.engine, "cmpl-hooked", park)

    assert answers[-1].freed_blocks > 0
    agent.wait_for(lambda m: isinstance(m, Update) and m.kv_blocks == 0, "an update of 0 blocks")
    assert server.engine.stats().kv_blocks_used == 0

    texts = read_to_the_end(client)

    resumed = agent.wait_for(lambda m: isinstance(m, Resumed), "resumed")
    assert isinstance(resumed, Resumed)
    assert resumed.request_id == "cmpl-hooked"
    assert resumed.kv_blocks > 0 and resumed.recomputed_tokens == 0
    closed = agent.wait_for(lambda m: isinstance(m, Close), "close")
    assert isinstance(closed, Close) and closed.reason == "finished"
    assert len(texts) == MAX_TOKENS
    assert "".join(texts) == unparked_text(server)


def test_an_engine_with_parking_off_does_not_offer_it(tmp_path: Path) -> None:
    agent = MiniAgent(tmp_path / "engine.sock")
    engine = Engine(tiny_config(park=False))
    hook = attach_hook(engine, str(tmp_path / "engine.sock"))
    hook.start()
    try:
        hello = agent.wait_for(lambda m: isinstance(m, EngineInfo), "hello")
        assert isinstance(hello, EngineInfo) and not hello.can(FEATURE_PARK)
    finally:
        hook.stop()
        agent.close()
