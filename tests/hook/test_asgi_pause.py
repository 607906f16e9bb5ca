"""Pause and release in the ASGI middleware (kvwatch.hook.asgi_pause), and its coalesced
egress (kvwatch.hook.asgi_coalesce): the Starlette SSE test app under real uvicorn (and
hypercorn), kvwatch's real HookServer as the agent, real TCP clients. Paused, the app's
generator is no longer pulled; released (by the agent, or by the hook when the lease runs
out) the client gets byte for byte what the bare app sends; a cancel, the client going away
and a detach each end a pause. Coalesced, the body is the bare app's in fewer, bounded
writes. An engine's own handlers (kvwatch.hook.asgi.EngineHandlers) replace the HTTP-side
pause: the hook runs them, the hook's own releases included, and the app's sends flow."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from kvwatch.hook.asgi import EngineHandlers, Middleware
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.agent_thread import HookServerThread
from kvwatch.lab.asgi_servers import SseApp, completion_request, serving
from kvwatch.lab.http_chunks import ChunkedResponse
from kvwatch.lab.waiting import wait_until

WAIT_SECONDS = 20.0
TOKENS = 300
PAD = 100  # about 170 bytes an event
HELD_MS = 60_000  # a lease that does not run out during a test


def stream(port: int, tag: str, tokens: int = TOKENS) -> ChunkedResponse:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(completion_request(port, tag, tokens, pad=PAD))
    return ChunkedResponse(sock).start()


def whole(response: ChunkedResponse) -> bytes:
    assert response.ended.wait(WAIT_SECONDS), "the response never ended"
    response.sock.close()
    return response.body


def bare_body(kind: str, tag: str) -> bytes:
    with serving(kind, SseApp().app) as bare:
        return whole(stream(bare.port, tag))


def command(
    hook_server: HookServerThread, name: str, request_id: str, lease_ms: int = 0
) -> CommandOutcome:
    server = hook_server.server
    return hook_server.call(server.command(name, request_id, "test", {}, lease_ms=lease_ms))


def announced(hook_server: HookServerThread, request_id: str) -> None:
    wait_until(lambda: hook_server.stream(request_id), WAIT_SECONDS, f"{request_id} announced")


@pytest.mark.parametrize("kind", ["uvicorn", "hypercorn"])
def test_a_paused_stream_pulls_nothing_from_the_app_and_released_sends_the_bare_bytes(
    kind: str, hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    expected = bare_body(kind, "p")
    app = SseApp(pause=0.005)
    with serving(kind, middlewares(app)) as server:
        response = stream(server.port, "p")
        announced(hook_server, "cmpl-p")
        assert command(hook_server, "pause", "cmpl-p", HELD_MS).status == "paused"
        yielded = app.yielded["cmpl-p"]
        time.sleep(0.3)  # deliberate: nothing may be pulled from the app while it is paused
        assert app.yielded["cmpl-p"] <= yielded + 1  # the send under way when it came
        stream_now = hook_server.stream("cmpl-p")
        assert stream_now is not None and stream_now.paused

        assert command(hook_server, "release", "cmpl-p").status == "released"
        body = whole(response)
    assert body == expected
    assert app.outcomes["cmpl-p"] == "finished"


def test_the_statuses_and_the_hook_releases_a_stream_whose_lease_ran_out(
    hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    app = SseApp(pause=0.005)
    middleware = middlewares(app)
    with serving("uvicorn", middleware) as server:
        response = stream(server.port, "l")
        announced(hook_server, "cmpl-l")
        (engine,) = hook_server.server.engines()
        features = engine["features"]
        assert isinstance(features, list) and {"pause", "detach"} <= set(features)
        assert command(hook_server, "release", "cmpl-l").status == "not_held"
        assert command(hook_server, "pause", "cmpl-none").status == "unknown_request"

        assert command(hook_server, "pause", "cmpl-l", lease_ms=200).status == "paused"
        whole(response)
        assert middleware.hook is not None
        assert middleware.hook.counters()["lease_expiries"] == 1
    assert app.outcomes["cmpl-l"] == "finished"


def test_a_cancel_ends_a_pause(
    hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    app = SseApp(pause=0.005)
    with serving("uvicorn", middlewares(app)) as server:
        response = stream(server.port, "c")
        announced(hook_server, "cmpl-c")
        assert command(hook_server, "pause", "cmpl-c", HELD_MS).status == "paused"
        assert command(hook_server, "cancel", "cmpl-c").status == "cancelled"
        assert response.ended.wait(WAIT_SECONDS)
        response.sock.close()
    assert app.outcomes["cmpl-c"] == "disconnected"


def test_a_client_that_goes_away_ends_a_pause(
    hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    app = SseApp(pause=0.005)
    with serving("uvicorn", middlewares(app)) as server:
        response = stream(server.port, "g")
        announced(hook_server, "cmpl-g")
        assert command(hook_server, "pause", "cmpl-g", HELD_MS).status == "paused"
        response.sock.shutdown(socket.SHUT_RDWR)
        response.sock.close()
        wait_until(lambda: not hook_server.stream("cmpl-g"), WAIT_SECONDS, "the stream's close")
    # The app was let go (its generator is closed when collected: "disconnected" then).
    assert app.outcomes["cmpl-g"] != "finished" and app.yielded["cmpl-g"] < TOKENS


def test_a_detach_ends_a_pause(
    hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    expected = bare_body("uvicorn", "d")
    app = SseApp(pause=0.005)
    with serving("uvicorn", middlewares(app)) as server:
        response = stream(server.port, "d")
        announced(hook_server, "cmpl-d")
        assert command(hook_server, "pause", "cmpl-d", HELD_MS).status == "paused"
        assert command(hook_server, "detach", "cmpl-d").status == "detached"
        assert command(hook_server, "pause", "cmpl-d").status == "declined"  # detached now
        body = whole(response)
    assert body == expected
    assert app.outcomes["cmpl-d"] == "finished"


def test_coalesced_writes_carry_the_bare_bytes_in_bounded_chunks(
    hook_server: HookServerThread,
    middlewares: Callable[..., Middleware],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = bare_body("uvicorn", "w")
    event_bytes = max(len(event) + 2 for event in expected.split(b"\n\n"))
    with serving("uvicorn", middlewares(SseApp(pause=0.001))) as server:  # 1024 B or 100 ms
        coalesced = stream(server.port, "w")
        body = whole(coalesced)
    monkeypatch.setenv("KVWATCH_COALESCE_BYTES", "0")
    with serving("uvicorn", middlewares(SseApp(pause=0.001))) as server:
        one_per_send = stream(server.port, "w")
        assert whole(one_per_send) == expected
    assert body == expected
    assert coalesced.chunks[0].count(b"data: ") == 1  # the first token, written at once
    assert max(len(chunk) for chunk in coalesced.chunks) < 1024 + event_bytes
    assert len(coalesced.chunks) < len(one_per_send.chunks) / 3


class EngineHolds:
    """An engine's own hold handlers that record each call (command, request id, reason) and
    answer as an engine that did what was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def handler(self, command: str, status: str) -> Callable[[str, str], CommandOutcome]:
        def run(request_id: str, reason: str) -> CommandOutcome:
            self.calls.append((command, request_id, reason))
            return CommandOutcome(request_id, status, 0, 0)

        return run

    def handlers(self, *, park: bool) -> EngineHandlers:
        return EngineHandlers(
            pause=self.handler("pause", "paused"),
            release=self.handler("release", "released"),
            park=self.handler("park", "parked") if park else None,
            engine="held-engine",
        )


@pytest.mark.parametrize("park", [True, False], ids=["with-park", "without-park"])
def test_an_engine_s_own_handlers_replace_the_http_side_pause(
    park: bool, hook_server: HookServerThread, middlewares: Callable[..., Middleware]
) -> None:
    expected = bare_body("uvicorn", "e")
    app, engine = SseApp(pause=0.005), EngineHolds()
    with serving("uvicorn", middlewares(app, engine_handlers=engine.handlers(park=park))) as server:
        response = stream(server.port, "e")
        announced(hook_server, "cmpl-e")
        (hello,) = hook_server.server.engines()
        features = hello["features"]
        assert hello["engine"] == "held-engine"
        assert isinstance(features, list) and {"pause", "detach"} <= set(features)
        assert ("park" in features) == park

        assert command(hook_server, "pause", "cmpl-e", HELD_MS).status == "paused"
        yielded = app.yielded["cmpl-e"]
        time.sleep(0.3)  # deliberate: the engine holds the request, the middleware holds nothing
        assert app.yielded["cmpl-e"] > yielded + 10
        if park:
            assert command(hook_server, "park", "cmpl-e", HELD_MS).status == "parked"
        assert command(hook_server, "pause", "cmpl-e", lease_ms=200).status == "paused"
        wait_until(
            lambda: ("release", "cmpl-e", "lease_expired") in engine.calls,
            WAIT_SECONDS,
            "the hook's release at the lease's end",
        )
        body = whole(response)
    assert body == expected
    held = [("pause", "cmpl-e"), ("park", "cmpl-e")] if park else [("pause", "cmpl-e")]
    assert [call[:2] for call in engine.calls] == [
        *held,
        ("pause", "cmpl-e"),
        ("release", "cmpl-e"),
    ]
