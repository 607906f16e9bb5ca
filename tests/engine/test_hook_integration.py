"""The engine with its kvwatch hook, against a minimal real agent on a unix socket.

The agent sees hello, then open with the client connection's 4-tuple exactly as the server
socket has it (whatever X-Forwarded-For or Forwarded say), then updates; its cancel frees
exactly that request's blocks, once, the client sees a reset, and the stream closes as
"cancelled". With no agent, the engine just serves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from kvwatch.hookwire.protocol import Cancel, Cancelled, Close, EngineInfo, Open, Update
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.engine_server import EngineServer, attach_hook
from kvwatch.lab.waiting import wait_until
from kvwatch.sockets import Endpoint
from tests.engine.conftest import MiniAgent, StalledClient, tiny_config

pytestmark = pytest.mark.engine


@pytest.mark.slow
def test_agent_cancel_frees_the_stalled_request_and_resets_its_client(
    hooked_server: tuple[EngineServer, MiniAgent],
) -> None:
    server, agent = hooked_server
    hello = agent.wait_for(lambda m: isinstance(m, EngineInfo), "hello")
    assert isinstance(hello, EngineInfo)
    assert hello.pid == os.getpid()
    assert hello.bytes_per_block == server.engine.description.bytes_per_block
    assert hello.kv_blocks_total == 64

    body = json.dumps({"prompt": "stall", "max_tokens": 900, "stream": True}).encode()
    # As a proxy sends it: uvicorn rewrites the ASGI client from these; the hook must not.
    forwarded = "X-Forwarded-For: 203.0.113.9\r\nForwarded: for=198.51.100.7\r\n"
    client = StalledClient(server.address, body, request_id="hooked", extra_headers=forwarded)
    try:
        opened = agent.wait_for(lambda m: isinstance(m, Open), "open")
        assert isinstance(opened, Open)
        assert opened.request_id == "cmpl-hooked"
        assert opened.local == Endpoint(*client.sock.getpeername())
        assert opened.remote == Endpoint(*client.sock.getsockname())

        def pinned_blocks() -> int:
            requests = server.engine.stats().requests
            return requests[0].kv_blocks if requests[0].state == "egress_blocked" else -1

        def reported_blocks() -> int:
            """The agent's newest view of the request's blocks."""
            updates = [m.kv_blocks for m in list(agent.messages) if isinstance(m, Update)]
            return updates[-1] if updates else -1

        # Bytes still in flight can let a blocked request advance once more: wait until the
        # engine's pinned blocks and the agent's newest update agree.
        wait_until(
            lambda: pinned_blocks() > 0 and reported_blocks() == pinned_blocks(),
            20,
            lambda: (
                f"the agent's newest update ({reported_blocks()} blocks) to match "
                f"the engine's pinned blocks ({pinned_blocks()})"
            ),
        )
        blocks = pinned_blocks()

        agent.send(Cancel(request_id="cmpl-hooked", reason="stalled", correlation_id="c-1"))
        answer = agent.wait_for(lambda m: isinstance(m, Cancelled), "cancelled")
        assert isinstance(answer, Cancelled)
        assert (answer.status, answer.freed_blocks) == ("cancelled", blocks)
        assert answer.correlation_id == "c-1"
        assert client.drain_until_closed() == "reset"
        closed = agent.wait_for(lambda m: isinstance(m, Close), "close")
        assert isinstance(closed, Close) and closed.reason == "cancelled"
        # The engine's stats are published at the end of the iteration that freed the blocks.
        wait_until(lambda: server.engine.stats().kv_blocks_used == 0, 5, "the stats' free blocks")

        agent.send(Cancel(request_id="cmpl-hooked", reason="stalled", correlation_id="c-2"))
        again = agent.wait_for(
            lambda m: isinstance(m, Cancelled) and m.correlation_id == "c-2", "second answer"
        )
        assert isinstance(again, Cancelled) and again.status == "already_finished"
    finally:
        client.close()


def test_engine_serves_normally_with_no_agent(tmp_path: Path) -> None:
    engine = Engine(tiny_config())
    hook = attach_hook(engine, str(tmp_path / "nobody-listens.sock"))
    server = EngineServer(engine, "127.0.0.1", 0, hook=hook)
    server.start_in_thread()
    try:
        for _ in range(3):
            response = httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": "hi", "max_tokens": 4, "stream": True},
                timeout=10,
            )
            assert response.status_code == 200
            assert response.text.endswith("data: [DONE]\n\n")
    finally:
        server.stop()
