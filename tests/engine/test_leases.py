"""Leases end without the agent (docs/protocol.md, "Pause and release"): the real engine, its
real `EngineHook`, and kvwatch's real `HookServer` as the agent. A pause or a park whose lease
runs out is released by the hook itself, and the agent's registry sees the request no longer
paused (or, parked, resumed once its client reads); when the agent's connection ends, the hook
releases every request it held. Clients are real TCP clients that stopped reading.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvwatch.hook import EngineHook
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.agent_thread import HookServerThread
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.engine_server import EngineServer, HookLike, attach_hook
from kvwatch.lab.waiting import wait_for, wait_until
from tests.engine.conftest import StalledClient, completion_text, tiny_config

pytestmark = pytest.mark.engine

WAIT_SECONDS = 20.0
LEASE_MS = 1000  # long enough to see the hold, short enough to wait for its end
PROMPT, MAX_TOKENS = "lease me", 150  # more than the socket buffers take


@dataclass
class Stack:
    agent: HookServerThread
    server: EngineServer
    hook: HookLike
    agent_running: bool = True

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def command(self, name: str, request_id: str, lease_ms: int = 0) -> CommandOutcome:
        """`name` sent by the agent, with a lease for a pause or a park."""
        agent = self.agent
        return agent.call(agent.server.command(name, request_id, "test", {}, lease_ms=lease_ms))

    def counter(self, name: str) -> int:
        assert isinstance(self.hook, EngineHook)
        return self.hook.counters()[name]

    def agent_sees_paused(self) -> bool:
        stream = self.agent.stream("cmpl-leased")
        return stream is not None and stream.paused

    def stop_agent(self) -> None:
        if self.agent_running:
            self.agent_running = False
            self.agent.close()


@pytest.fixture
def stack(socket_path: str) -> Iterator[Stack]:
    agent = HookServerThread(socket_path)
    engine = Engine(tiny_config(kv_blocks=64, debug_checks=True))
    hook = attach_hook(engine, socket_path)
    server = EngineServer(engine, "127.0.0.1", 0, sndbuf_bytes=4096, hook=hook)
    server.start_in_thread()
    stack = Stack(agent, server, hook)
    yield stack
    server.stop()
    stack.stop_agent()


@pytest.fixture
def stalled(stack: Stack) -> Iterator[StalledClient]:
    """A client that stopped reading, its stream announced to the agent and holding KV."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    client = StalledClient(stack.server.address, body, request_id="leased")
    wait_for(
        lambda: (s := stack.agent.stream("cmpl-leased")) is not None and s.kv_blocks > 0,
        WAIT_SECONDS,
        "the stream announced with its KV",
    )
    yield client
    client.close()


def state(stack: Stack) -> str:
    return next(r.state for r in stack.engine.stats().requests if r.request_id == "cmpl-leased")


def test_a_pause_whose_lease_runs_out_is_released_by_the_hook(
    stack: Stack, stalled: StalledClient
) -> None:
    assert stack.command("pause", "cmpl-leased", LEASE_MS).status == "paused"
    wait_until(stack.agent_sees_paused, WAIT_SECONDS, "the agent seeing the pause")
    wait_until(lambda: stack.engine.stats().num_pauses == 1, WAIT_SECONDS, "the engine pausing it")

    wait_until(lambda: not stack.agent_sees_paused(), WAIT_SECONDS, "the agent seeing it end")
    wait_until(lambda: state(stack) != "paused", WAIT_SECONDS, "the engine running it again")
    assert stack.counter("lease_expiries") == 1
    assert stack.engine.stats().num_releases == 1


def test_a_park_whose_lease_runs_out_resumes_once_its_client_reads(
    stack: Stack, stalled: StalledClient
) -> None:
    parked = stack.command("park", "cmpl-leased", LEASE_MS)
    assert parked.status == "parked" and parked.freed_blocks > 0
    wait_until(lambda: stack.engine.stats().num_releases == 1, WAIT_SECONDS, "the hook's release")
    assert stack.counter("lease_expiries") == 1
    assert state(stack) != "parked"  # at the head of the queue, or running with its KV back

    texts = stalled.read_to_the_end()  # its client reads: it resumes, its KV copied back

    assert "".join(texts) == completion_text(stack.server, PROMPT, MAX_TOKENS)
    assert stack.engine.stats().num_resumes == 1


def test_the_hook_releases_what_it_held_when_the_agent_goes_away(
    stack: Stack, stalled: StalledClient
) -> None:
    assert stack.command("pause", "cmpl-leased", 60_000).status == "paused"
    wait_until(lambda: state(stack) == "paused", WAIT_SECONDS, "the pause")

    stack.stop_agent()

    wait_until(lambda: state(stack) != "paused", WAIT_SECONDS, "the hook's release")
    assert stack.counter("releases_without_agent") == 1
    assert stack.counter("lease_expiries") == 0
