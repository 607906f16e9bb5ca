"""The two egress modes with a client that stops reading, over real HTTP on loopback.

coupled: the stalled request keeps its KV blocks, a queued request waits until the stalled one
is cancelled, and the cancelled client sees a TCP reset. decoupled: generation runs on into the
host buffer and the blocks are free at finish, while the client still has not read.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from kvwatch.lab.engine.engine_server import EngineServer
from kvwatch.lab.engine.metrics import RequestSnapshot
from kvwatch.lab.waiting import wait_until
from tests.engine.conftest import StalledClient

pytestmark = pytest.mark.engine

POOL_BLOCKS = 64


def snapshot(server: EngineServer, request_id: str) -> RequestSnapshot | None:
    return next((r for r in server.engine.stats().requests if r.request_id == request_id), None)


def settled_snapshot(server: EngineServer, request_id: str) -> RequestSnapshot:
    """The request's snapshot once it stayed the same for 0.5 s (at most 10 s of waiting)."""
    deadline = time.monotonic() + 10
    previous = snapshot(server, request_id)
    while time.monotonic() < deadline:
        time.sleep(0.5)  # deliberate: "settled" means unchanged over this half second
        current = snapshot(server, request_id)
        if current is not None and current == previous:
            return current
        previous = current
    raise AssertionError(f"{request_id} never settled: {previous}")


def stall(server: EngineServer, clients: list[StalledClient], max_tokens: int) -> StalledClient:
    body = json.dumps({"prompt": "stall", "max_tokens": max_tokens, "stream": True}).encode()
    client = StalledClient(server.address, body, request_id="stalled")
    clients.append(client)
    return client


def metric_value(server: EngineServer, line_prefix: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith(line_prefix))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow
def test_coupled_stall_pins_kv_until_cancel_then_queue_moves_and_client_is_reset(
    make_server: Callable[..., EngineServer], stalled_clients: list[StalledClient]
) -> None:
    server = make_server(kv_blocks=POOL_BLOCKS, egress="coupled")
    engine = server.engine
    client = stall(server, stalled_clients, max_tokens=900)

    # The request stops advancing once its queue is full, and keeps its blocks. Bytes still in
    # flight can drain into the client's receive buffer and unblock it briefly, so "stopped"
    # means: no change over half a second.
    wait_until(
        lambda: getattr(snapshot(server, "cmpl-stalled"), "state", "") == "egress_blocked",
        20,
        "the stalled request blocked on its full queue",
    )
    pinned = settled_snapshot(server, "cmpl-stalled")
    assert pinned.kv_blocks > 0
    time.sleep(0.5)  # deliberate: nothing may change while the client still does not read
    assert snapshot(server, "cmpl-stalled") == pinned

    # A request whose prompt needs one block more than is free waits behind it.
    free_blocks = POOL_BLOCKS - engine.stats().kv_blocks_used
    prompt = "x" * (free_blocks * engine.description.block_size)  # + BOS: one token too many
    queued: dict[str, object] = {}

    def queued_request() -> None:
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 8},
            headers={"X-Request-Id": "queued"},
            timeout=30,
        )
        queued["body"] = response.json()

    thread = threading.Thread(target=queued_request)
    thread.start()
    wait_until(
        lambda: getattr(snapshot(server, "cmpl-queued"), "state", "") == "waiting",
        20,
        "the queued request waiting for blocks",
    )
    time.sleep(0.5)  # deliberate: it must go on waiting while the stalled one pins its blocks
    assert getattr(snapshot(server, "cmpl-queued"), "state", "") == "waiting"
    assert snapshot(server, "cmpl-stalled") == pinned

    outcome = engine.cancel("cmpl-stalled", "client stalled")
    assert outcome.status == "cancelled"
    assert outcome.freed_blocks == pinned.kv_blocks
    assert outcome.freed_bytes == pinned.kv_blocks * engine.description.bytes_per_block

    thread.join(30)
    body = queued["body"]
    assert isinstance(body, dict)
    assert body["usage"]["completion_tokens"] == 8
    assert client.drain_until_closed() == "reset"
    assert engine.cancel("cmpl-stalled", "again").status == "already_finished"
    assert engine.cancel("cmpl-never-seen", "typo").status == "unknown_request"
    aborted = 'kvwatch_engine:request_success_total{finished_reason="abort"}'
    assert metric_value(server, aborted) == 1.0


def test_decoupled_frees_kv_at_finish_while_the_client_still_stalls(
    make_server: Callable[..., EngineServer], stalled_clients: list[StalledClient]
) -> None:
    server = make_server(kv_blocks=POOL_BLOCKS, egress="decoupled")
    client = stall(server, stalled_clients, max_tokens=300)
    wait_until(lambda: not server.engine.stats().requests, 20, "the request finished")
    assert server.engine.stats().kv_blocks_used == 0
    assert metric_value(server, "kvwatch_engine:kv_cache_blocks_used") == 0.0

    # Nothing was lost: the buffered stream is all there once the client reads again.
    client.sock.settimeout(10.0)
    data = client.received
    while b"data: [DONE]" not in data:
        chunk = client.sock.recv(65536)
        assert chunk, "stream ended before [DONE]"
        data += chunk
    texts = [
        json.loads(line[len("data: ") :])["choices"][0]["text"]
        for line in data.decode().split("\n")
        if line.startswith("data: {")
    ]
    assert len("".join(texts)) == 300


def test_client_that_hangs_up_mid_stream_frees_its_request(
    make_server: Callable[..., EngineServer],
) -> None:
    server = make_server(kv_blocks=POOL_BLOCKS, egress="coupled")
    body = {"prompt": "bye", "max_tokens": 900, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=10) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The client closed its connection (FIN): the engine aborts the request and frees it.
    wait_until(lambda: not server.engine.stats().requests, 20, "the request aborted")
    assert server.engine.stats().kv_blocks_used == 0
    aborted = 'kvwatch_engine:request_success_total{finished_reason="abort"}'
    assert metric_value(server, aborted) == 1.0
