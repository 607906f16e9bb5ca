"""run_load against real streaming servers on loopback: each client class and each outcome."""

from __future__ import annotations

import asyncio
from typing import Any

from kvwatch.lab.loadgen import LoadPlan, LoadReport, run_load
from tests.loadgen.sse_server import Behaviour, SseServer


def _run(plan: LoadPlan, **options: Any) -> LoadReport:
    return asyncio.run(run_load(plan, **options))


def test_healthy_clients_finish_with_sane_ttft_and_itl(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(tokens=10, token_delay_seconds=0.02)
    report = _run(LoadPlan(url=sse_server.url, healthy=2, duration_seconds=1.0, max_tokens=10))

    healthy = report.classes["healthy"]
    assert report.model == "test-model"
    assert report.url == f"{sse_server.url}/v1/completions"
    assert healthy.finished >= 4
    assert healthy.finished + healthy.incomplete == healthy.requests
    assert healthy.in_flight == healthy.error == healthy.reset == healthy.cancelled == 0
    assert healthy.ttft_seconds.p50 is not None
    assert healthy.itl_seconds.p50 is not None
    assert 0.015 <= healthy.ttft_seconds.p50 <= 0.3
    assert 0.015 <= healthy.itl_seconds.p50 <= 0.1
    assert healthy.tokens >= 10 * healthy.finished
    assert abs(healthy.tokens_per_second * report.duration_seconds - healthy.tokens) < 1e-6
    assert sse_server.seen.requests[0] == {
        "model": "test-model",
        "max_tokens": 10,
        "stream": True,
        "prompt": LoadPlan.prompt,
    }
    assert report.classes["slow"].requests == report.classes["stalled"].requests == 0


def test_stalled_client_holds_its_connection_while_the_server_is_blocked(
    sse_server: SseServer,
) -> None:
    sse_server.behaviour = Behaviour(
        tokens=5000, token_delay_seconds=0.001, padding_bytes=1000, sndbuf_bytes=16384
    )
    blocked: list[int] = []
    report = _run(
        LoadPlan(url=sse_server.url, healthy=0, stalled=1, duration_seconds=1.0),
        on_progress=lambda _: blocked.append(sse_server.blocked_writers()),
        progress_interval_seconds=0.2,
    )

    stalled = report.classes["stalled"]
    assert (stalled.requests, stalled.stalled, stalled.reset, stalled.error) == (1, 1, 0, 0)
    assert stalled.ttft_seconds.count == 1
    assert stalled.tokens >= 1
    assert max(blocked) == 1, "the server's writes never backed up behind the stalled client"


def test_server_reset_of_a_stalled_client_counts_as_reset(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(
        tokens=5000, token_delay_seconds=0.001, padding_bytes=1000, reset_after_seconds=0.3
    )
    report = _run(LoadPlan(url=sse_server.url, healthy=0, stalled=1, duration_seconds=1.1))

    stalled = report.classes["stalled"]
    assert stalled.reset >= 2  # a stalled client stalls again after each reset
    assert stalled.error == 0
    assert stalled.reset_after_seconds.p50 is not None
    assert 0.3 <= stalled.reset_after_seconds.p50 < 0.6


def test_reset_mid_stream_and_early_end_are_told_apart(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(tokens=10, token_delay_seconds=0.01, reset_after_tokens=3)
    reset = _run(LoadPlan(url=sse_server.url, healthy=1, duration_seconds=0.5))
    sse_server.behaviour = Behaviour(tokens=10, token_delay_seconds=0.01, end_after_tokens=3)
    ended = _run(LoadPlan(url=sse_server.url, healthy=1, duration_seconds=0.5))

    healthy = reset.classes["healthy"]
    assert healthy.reset >= 3
    assert healthy.finished == healthy.cancelled == healthy.error == 0
    assert healthy.reset_after_seconds.count == healthy.reset
    assert ended.classes["healthy"].cancelled >= 3
    assert ended.classes["healthy"].finished == ended.classes["healthy"].reset == 0


def test_slow_clients_read_at_their_rate(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(tokens=40, token_delay_seconds=0.005, padding_bytes=200)
    report = _run(
        LoadPlan(
            url=sse_server.url, healthy=1, slow=1, duration_seconds=1.0, slow_bytes_per_second=3000
        )
    )
    healthy, slow = report.classes["healthy"], report.classes["slow"]
    event_bytes = 300  # each event is about 300 bytes on the wire
    assert slow.error == slow.reset == 0
    assert 1 <= slow.tokens * event_bytes <= 1.5 * 3000 * report.duration_seconds
    assert slow.tokens_per_second * 3 < healthy.tokens_per_second
    assert slow.itl_seconds.p50 is not None
    assert slow.itl_seconds.p50 > 0.05


def test_http_errors_are_counted_with_a_sample(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(status=503)
    report = _run(LoadPlan(url=sse_server.url, healthy=1, duration_seconds=0.5, model="m"))
    healthy = report.classes["healthy"]
    assert healthy.error >= 1
    assert healthy.tokens == 0
    assert healthy.errors[0].startswith("HTTP 503: ")
    assert "model overloaded" in healthy.errors[0]


def test_chat_stream_from_starlette_on_uvicorn(starlette_url: str) -> None:
    report = _run(
        LoadPlan(
            url=starlette_url + "/v1",
            endpoint="chat",
            healthy=2,
            max_tokens=8,
            duration_seconds=0.6,
        )
    )
    healthy = report.classes["healthy"]
    assert report.model == "starlette-model"
    assert healthy.finished >= 2
    assert healthy.error == healthy.reset == healthy.cancelled == 0
    assert healthy.tokens >= 8 * healthy.finished  # the role-only first chunk is not a token
    assert healthy.ttft_seconds.count == healthy.requests
