"""Detach's host buffers in the ASGI middleware (docs/protocol.md, "Detach"), with the
Starlette SSE test app under uvicorn and hypercorn, kvwatch's real HookServer as the agent
and clients with the kernel's default receive buffer: a detached stream buffers up to its
cap, is coupled again there (reported full) and still delivers every byte in order; many
stay within the total cap; a response buffered from its start is not detached again."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvwatch.hook.asgi import Middleware
from kvwatch.lab.agent_thread import BACKED_UP_SECONDS_PER_STREAM, HookServerThread
from kvwatch.lab.asgi_servers import SseApp, completion_request, open_client, read_all, serving
from kvwatch.lab.waiting import wait_until

SERVERS = ("uvicorn", "hypercorn")
SNDBUF_BYTES = 64 * 1024
WAIT_SECONDS = 30.0


def _coupled_again(hook_server: HookServerThread) -> bool:
    """Every live stream's buffer was reported full: none is detached any more."""
    streams = hook_server.streams().values()
    return bool(streams) and all(s.egress_buffer_full and not s.detached for s in streams)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_stream_coupled_again_at_its_cap_still_delivers_every_byte_in_order(
    kind: str,
    hook_server: HookServerThread,
    middlewares: Callable[..., Middleware],
) -> None:
    app = SseApp(pause=0)
    request = completion_request(0, "c", 400, pad=4096)  # 1.6 MB of events
    with serving(kind, app.app) as bare:
        expected = read_all(open_client(bare.port, request)).split(b"\r\n\r\n", 1)[1]
    middleware = middlewares(app, detach_buffer_bytes=128 * 1024)
    with serving(kind, middleware, sndbuf=SNDBUF_BYTES) as server:
        client = open_client(server.port, request)
        (held,) = hook_server.backed_up()
        outcome = hook_server.command("detach", held.request_id)
        wait_until(lambda: _coupled_again(hook_server), WAIT_SECONDS, "the stream coupled again")
        buffered = middleware.egress_budget.buffered_bytes
        body = read_all(client, WAIT_SECONDS).split(b"\r\n\r\n", 1)[1]
        client.close()
        wait_until(lambda: not hook_server.streams(), WAIT_SECONDS, "its close")
    assert (outcome.status, outcome.buffered_bytes > 0) == ("detached", True)
    assert 128 * 1024 - 4096 - 1024 < buffered <= 128 * 1024
    assert body == expected
    assert app.outcomes["cmpl-c"] == "finished"
    assert middleware.egress_budget.buffered_bytes == 0


def test_a_response_buffered_from_its_start_is_not_detached_again(
    hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    app = SseApp(pause=0.01)
    middleware = middlewares(app, egress_buffer_bytes=1 << 20)
    with serving("uvicorn", middleware) as server:
        client = open_client(server.port, completion_request(server.port, "b", 50))
        wait_until(lambda: hook_server.stream("cmpl-b"), WAIT_SECONDS, "its announce")
        outcome = hook_server.command("detach", "cmpl-b")
        unknown = hook_server.command("detach", "cmpl-none")
        read_all(client)
        client.close()
    assert (outcome.status, outcome.buffered_bytes) == ("declined", 0)
    assert "every response is buffered here already" in outcome.detail
    assert unknown.status == "unknown_request"


@pytest.mark.slow
@pytest.mark.timeout(600)  # its waits grow with the machine's load (below)
def test_two_hundred_detached_streams_stay_within_the_buffer_caps(
    hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    """Streams that never end and clients that never read: each detached stream buffers until
    its own cap or the total's, is coupled again (reported full), and the host bytes held by
    all of them never pass the total cap (smaller than the 200 streams' caps together)."""
    streams, per_stream, total, pad = 200, 32 * 1024, 4 * 1024 * 1024, 4 * 1024
    app = SseApp(pause=0)
    middleware = middlewares(app, detach_buffer_bytes=per_stream, egress_total_bytes=total)
    budget = middleware.egress_budget
    with serving("uvicorn", middleware, sndbuf=SNDBUF_BYTES) as server:
        started = time.monotonic()
        clients = [
            open_client(server.port, completion_request(server.port, f"d{i}", 100_000, pad=pad))
            for i in range(streams)
        ]
        ids = [stream.request_id for stream in hook_server.backed_up(streams)]
        backing_up_seconds = time.monotonic() - started
        app.pause = 0.2  # 20 KB/s a stream from now on: detached before the total is met
        outcomes = [hook_server.command("detach", request_id) for request_id in ids]
        # One event loop (and one interpreter) serves them all: their pace, like backing up,
        # scales with their number and with the machine's load, which backing up measured
        # (a few seconds alone; 176 s for this whole test once in the parallel suite).
        many_seconds = max(
            WAIT_SECONDS + streams * BACKED_UP_SECONDS_PER_STREAM, 3 * backing_up_seconds
        )
        # Every stream coupled again once it met a cap, and the total's cap met: a stream
        # whose buffer then drained into its socket reports itself not full any more (under
        # load, 13 of 200 did), so "every one reported full" is not what to wait for.
        wait_until(
            lambda: (
                budget.peak_bytes > total - pad - 1024
                and not any(stream.detached for stream in hook_server.streams().values())
            ),
            many_seconds,
            "every stream at a cap",
        )
        peak_bytes = budget.peak_bytes
        for client in clients:
            client.close()  # unread data: a reset
        wait_until(lambda: budget.buffered_bytes == 0, many_seconds, "every buffer dropped")
    # Detaches go one after another; under load the streams detached first can fill the
    # total before the last are asked, and those are declined: no room for their output.
    declined = [o for o in outcomes if o.status != "detached"]
    assert all(o.status == "declined" and "no room" in o.detail for o in declined), declined
    assert len(declined) < streams // 2
    assert total - pad - 1024 < peak_bytes <= total
    assert all(app.outcomes[request_id] != "finished" for request_id in ids)
