"""Timelines stay bounded whatever engines announce (issue #13, finding 5), and `explain` calls
a stream live only while the collector sees its socket, with sock_diag polling too."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from kvwatch.api.routes import build_app
from kvwatch.config.load import load_config
from kvwatch.daemon.daemon import Daemon
from kvwatch.hook import CommandOutcome, EngineHook
from kvwatch.streams import timeline
from kvwatch.streams.timeline import Timelines
from tests.hookserver.conftest import ENGINE_INFO, run_async, wait_until


def test_announced_connections_never_seen_by_the_collector_are_closed_as_gone() -> None:
    timelines = Timelines(history_size=100, max_live=5000)
    opened = 30_000
    for index in range(opened):
        timelines.bind((f"10.0.0.1:{index % 60000}", f"10.0.0.2:{index}"), f"r-{index}", 0)
    assert timelines.live_count() == 5000  # the oldest were evicted
    later = time.monotonic_ns() + timeline.UNSEEN_NS
    assert timelines.sweep(set(), later) == 5000
    assert (timelines.live_count(), timelines.finished_count()) == (0, 100)
    gone = timelines.find(f"r-{opened - 1}")
    assert gone is not None and gone.closed
    assert gone.entries[-1]["event"] == "gone"
    assert timelines.find("r-0") is None  # past the history


def test_a_seen_socket_keeps_its_timeline_live() -> None:
    timelines = Timelines(history_size=10)
    seen, unseen = ("a:1", "b:1"), ("a:2", "b:2")
    timelines.bind(seen, "seen", 0)
    timelines.bind(unseen, "unseen", 0)
    now = time.monotonic_ns()
    for step in range(1, 4):
        timelines.sweep({seen}, now + step * timeline.UNSEEN_NS // 2)
    assert not timelines.find("seen").closed  # type: ignore[union-attr]
    assert timelines.find("unseen").closed  # type: ignore[union-attr]


def test_live_timelines_are_capped_oldest_first() -> None:
    timelines = Timelines(history_size=10, max_live=5)
    for index in range(8):
        timelines.bind(("a:1", f"b:{index}"), f"r-{index}", 0)
    assert timelines.live_count() == 5
    evicted = timelines.find("r-0")
    assert evicted is not None and evicted.entries[-1]["event"] == "evicted"
    assert not timelines.find("r-7").closed  # type: ignore[union-attr]


def test_a_kept_alive_connection_forgets_its_previous_request() -> None:
    timelines = Timelines(history_size=10)
    for index in range(1000):
        timelines.bind(("a:1", "b:1"), f"r-{index}", 0)
    assert timelines.find("r-0") is None
    assert timelines.find("r-999") is not None
    assert len(timelines._by_request) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="sock_diag needs root")
def test_diag_mode_explain_is_live_only_while_the_socket_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timeline, "UNSEEN_NS", 500_000_000)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    config = load_config(
        None,
        {},
        {
            "collector.backend": "diag",
            "collector.ports": (port,),
            "hook.socket": str(tmp_path / "engine.sock"),
            "audit.path": "",
        },
    )

    async def explain(daemon: Daemon) -> dict[str, object]:
        transport = httpx.ASGITransport(app=build_app(daemon, daemon.registry))
        async with httpx.AsyncClient(transport=transport, base_url="http://agent") as client:
            answer = await client.get("/api/v1/explain/cmpl-diag")
        assert answer.status_code == 200
        body: dict[str, object] = answer.json()
        return body

    async def scenario() -> None:
        daemon = Daemon(config)
        await daemon.start()
        running = asyncio.create_task(daemon.run())
        hook = EngineHook(
            ENGINE_INFO,
            lambda request_id, _: CommandOutcome(request_id, "unknown_request", 0, 0),
            config.hook.socket,
            reconnect_seconds=0.1,
        )
        hook.start()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        try:
            hook.stream_opened(
                "cmpl-diag", accepted.getsockname(), accepted.getpeername(), kv_blocks=1
            )
            await wait_until(lambda: daemon.timelines.find("cmpl-diag") is not None)
            await wait_until(lambda: len(daemon.samples()) == 1)
            assert (await explain(daemon))["live"] is True
            (sample,) = daemon.samples()
            episode = daemon.runner.episodes.begin(sample, time.monotonic_ns())
            episode.stall_for(sample).acted = True  # as after a decision
            client.close()
            accepted.close()
            await wait_until(lambda: daemon.timelines.find("cmpl-diag").closed)  # type: ignore[union-attr]
            body = await explain(daemon)
            assert body["live"] is False
            assert [e["event"] for e in body["timeline"]][-1] == "gone"  # type: ignore[attr-defined]
            assert daemon.runner.episodes.get(sample) is None  # what diag mode no longer sees ended
        finally:
            await asyncio.to_thread(hook.stop)
            daemon.stop()
            await running
            await daemon.close()
            server.close()

    run_async(scenario(), timeout_seconds=30)
