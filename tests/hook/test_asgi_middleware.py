"""The ASGI middleware under real uvicorn and hypercorn, against a real (test) agent: real
addresses despite proxy headers, a request announced at its first token by the engine's id
(not at sse-starlette's pings before it), cancels that reach the app as http.disconnect and
reset the client, and a server that behaves as without kvwatch when the agent is absent, slow
or rude."""

from __future__ import annotations

import importlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI

from kvwatch.hook.asgi import Middleware
from kvwatch.hook.asgi_kv import prompt_tokens
from kvwatch.hookwire.protocol import Cancel, Cancelled, Close, EngineInfo, Message, Open, Update
from kvwatch.lab.asgi_servers import (
    PingingSseApp,
    SseApp,
    completion_request,
    open_client,
    read_all,
    read_until,
    serving,
)
from tests.hook.hook_agent import AgentServer, of_kind, wait_until

AgentFactory = Callable[..., AgentServer]
SERVERS = ("uvicorn", "hypercorn")
BYTES_PER_TOKEN = 1000
STALL_RCVBUF = 4096
PING_SECONDS = 0.05
ENGINE_ID = re.compile(rb'"id": "(cmpl-[0-9a-f]+)"')


@pytest.fixture
def middlewares() -> Iterator[Callable[..., Middleware]]:
    built: list[Middleware] = []

    def build(app: SseApp | PingingSseApp, socket_path: str, **options: Any) -> Middleware:
        middleware = Middleware(
            app.app,
            socket_path=socket_path,
            bytes_per_token=BYTES_PER_TOKEN,
            reconnect_seconds=0.2,
            **options,
        )
        built.append(middleware)
        return middleware

    yield build
    for middleware in built:
        middleware.close()


@pytest.mark.parametrize("kind", SERVERS)
def test_streams_are_announced_with_the_sockets_real_addresses(
    kind: str, socket_path: str, agent_factory: AgentFactory, middlewares: Callable[..., Middleware]
) -> None:
    agent = agent_factory()
    app = SseApp()
    proxied = {
        "X-Forwarded-For": "203.0.113.9",
        "Forwarded": "for=198.51.100.7;proto=https",
        "X-Request-Id": "req-7",
    }
    with serving(kind, middlewares(app, socket_path), proxy_headers=True) as server:
        client = open_client(server.port, completion_request(server.port, "a", 40, proxied))
        body = read_all(client)
        local, remote = client.getpeername(), client.getsockname()
        client.close()
        unnamed = open_client(server.port, completion_request(server.port, "b", 5))
        read_all(unnamed)
        unnamed.close()
        opened = agent.first(Open, "req-7")
        closed = agent.first(Close, "req-7")
        assert agent.first(Open, "cmpl-b").kv_estimated  # no header: the first event's id
    assert body.count(b"data:") == 41
    assert (str(opened.local), str(opened.remote)) == (
        f"{local[0]}:{local[1]}",
        f"{remote[0]}:{remote[1]}",
    )
    # The app was told the forwarded client; the agent hears the socket's.
    assert app.scope_clients["cmpl-a"] in ("203.0.113.9", "198.51.100.7")
    assert opened.kv_estimated
    assert closed.reason == "finished"
    updates = of_kind(agent.messages, Update, "req-7")
    assert updates and all(u.kv_estimated for u in updates)
    assert max(u.tokens_out for u in updates) == 40
    assert isinstance(agent.messages[0], EngineInfo)
    assert agent.messages[0].engine == "asgi"


@pytest.mark.parametrize(
    ("kind", "sep"), [("uvicorn", "\r\n"), ("hypercorn", "\n"), ("uvicorn", "\r")]
)
def test_a_request_waiting_behind_pings_is_announced_at_its_first_token_by_the_engines_id(
    kind: str,
    sep: str,
    socket_path: str,
    agent_factory: AgentFactory,
    middlewares: Callable[..., Middleware],
) -> None:
    """sse-starlette pings a response whose engine has not started (llama-cpp-python's
    request waiting for the generation lock): no announce, no KV, until its first token; then
    the engine's own `cmpl-…` id and an estimate that counts tokens, not pings."""
    agent = agent_factory()
    app = PingingSseApp(ping=PING_SECONDS, pause=3 * PING_SECONDS, sep=sep)
    middleware = middlewares(app, socket_path)
    tokens = 6
    with serving(kind, middleware) as server:
        request = completion_request(server.port, "waiting", tokens)
        client = open_client(server.port, request)
        waited = read_until(client, lambda data: data.count(b": ping") >= 3)
        agent.wait_for(lambda ms: bool(of_kind(ms, EngineInfo)))  # the hook is connected
        assert middleware.hook is not None
        live_while_waiting = middleware.hook.counters()["live_streams"]
        heard_while_waiting = of_kind(agent.messages, Open) + of_kind(agent.messages, Update)
        app.gate.set()  # the engine starts generating
        streamed = read_all(client)
        client.close()
        found = ENGINE_ID.search(streamed)
        assert found is not None, streamed
        engine_id = found.group(1).decode()
        opened, closed = agent.first(Open, engine_id), agent.first(Close, engine_id)
    assert b"data:" not in waited
    assert (live_while_waiting, heard_while_waiting) == (0, [])
    assert [m.request_id for m in of_kind(agent.messages, Open)] == [engine_id]
    prompt = prompt_tokens(len(request.split(b"\r\n\r\n", 1)[1]))
    assert opened.kv_blocks == prompt + 1  # from the first token on: the prompt's and its own
    updates = of_kind(agent.messages, Update, engine_id)
    assert all(u.kv_blocks == prompt + u.tokens_out for u in updates)
    assert max(u.tokens_out for u in updates) == tokens
    assert streamed.count(b": ping") > 0  # pings came between the tokens and were not counted
    assert closed.reason == "finished"


@pytest.mark.parametrize("kind", SERVERS)
def test_a_cancel_reaches_the_app_as_a_disconnect_and_resets_the_client(
    kind: str, socket_path: str, agent_factory: AgentFactory, middlewares: Callable[..., Middleware]
) -> None:
    agent = agent_factory()
    app = SseApp()
    with serving(kind, middlewares(app, socket_path)) as server:
        stalled = open_client(
            server.port, completion_request(server.port, "stalled", 100_000), rcvbuf=STALL_RCVBUF
        )
        assert stalled.recv(256)
        opened = agent.first(Open, "cmpl-stalled")
        healthy = open_client(server.port, completion_request(server.port, "healthy", 300))
        agent.send(Cancel(request_id="cmpl-stalled", reason="stalled", correlation_id="c-1"))
        answer = _answer(agent, "c-1")
        outcome_at_answer = app.outcomes["cmpl-stalled"]
        healthy_body = read_all(healthy)
        healthy.close()
        closed = agent.first(Close, "cmpl-stalled")
        with pytest.raises(ConnectionResetError):
            _read_until_reset(stalled)
        stalled.close()
        assert app.outcomes["cmpl-healthy"] == "finished"
    # The generator saw the disconnect before the agent heard "cancelled" (vLLM aborts there).
    assert outcome_at_answer == "disconnected"
    assert opened.kv_estimated
    assert answer.status == "cancelled"
    assert answer.freed_blocks > 0
    assert answer.freed_bytes == answer.freed_blocks * BYTES_PER_TOKEN
    assert closed.reason == "cancelled"
    assert healthy_body.count(b"data:") == 301
    agent.send(Cancel(request_id="cmpl-stalled", reason="stalled", correlation_id="c-2"))
    assert _answer(agent, "c-2").status == "unknown_request"  # gone: nothing more to free


def _answer(agent: AgentServer, correlation_id: str) -> Cancelled:
    messages = agent.wait_for(
        lambda ms: any(getattr(m, "correlation_id", "") == correlation_id for m in ms), 10
    )
    answer = next(m for m in messages if getattr(m, "correlation_id", "") == correlation_id)
    assert isinstance(answer, Cancelled)
    return answer


def _read_until_reset(client: socket.socket) -> None:
    client.settimeout(10)
    while client.recv(65536):
        pass


def test_vllm_loads_it_by_dotted_path_with_add_middleware() -> None:
    """What vLLM's build_app does with `--middleware PATH`: split at the last dot, import,
    and `app.add_middleware(cls)` for a class — no arguments."""
    path = "kvwatch.hook.asgi.Middleware"
    module_path, name = path.rsplit(".", 1)
    imported = getattr(importlib.import_module(module_path), name)
    app = FastAPI()
    app.add_middleware(imported)
    stack = app.build_middleware_stack()
    found: Any = stack
    while not isinstance(found, Middleware):
        found = found.app
    assert isinstance(found, Middleware)
    found.close()


def test_the_middleware_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvwatch.hook.asgi; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def _sse_data(raw: bytes) -> list[bytes]:
    return [line for line in raw.split(b"\n") if line.startswith(b"data:")]


def _stream_once(port: int, tag: str, tokens: int) -> list[bytes]:
    client = open_client(port, completion_request(port, tag, tokens))
    try:
        return _sse_data(read_all(client))
    finally:
        client.close()


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize("agent_kind", ["absent", "not_reading", "garbage"])
def test_the_app_serves_as_without_kvwatch_whatever_the_agent_does(
    kind: str,
    agent_kind: str,
    socket_path: str,
    agent_factory: AgentFactory,
    middlewares: Callable[..., Middleware],
) -> None:
    if agent_kind != "absent":
        agent = agent_factory(reading=agent_kind != "not_reading")
    app = SseApp(pause=0)
    with serving(kind, app.app) as bare:
        expected = _stream_once(bare.port, "same", 200)
    middleware = middlewares(app, socket_path)
    with serving(kind, middleware) as server:
        if agent_kind == "garbage":
            assert middleware.hook is None  # started by the first request
            _stream_once(server.port, "first", 1)
            agent.send(b"\xff\xfe not json\n{}\n" + b"x" * 70_000 + b"\n")
            agent.send(Cancel(request_id="nobody", reason="stalled", correlation_id="g-1"))
        started = time.monotonic()
        got = [_stream_once(server.port, "same", 200) for _ in range(5)]
        elapsed = time.monotonic() - started
    assert all(body == expected for body in got)
    assert elapsed < 10, f"5 streams took {elapsed:.1f} s"
    assert middleware.hook is not None
    counters = middleware.hook.counters()
    if agent_kind == "absent":
        assert counters["connect_failures"] >= 1 and counters["sent"] == 0
    if agent_kind == "garbage":
        assert counters["malformed_received"] >= 2
        assert _answer(agent, "g-1").status == "unknown_request"


@pytest.mark.parametrize("kind", SERVERS)
def test_decoupled_egress_lets_the_app_finish_before_a_slow_client_reads(
    kind: str, socket_path: str, agent_factory: AgentFactory, middlewares: Callable[..., Middleware]
) -> None:
    agent = agent_factory()
    app = SseApp(pause=0)
    middleware = middlewares(app, socket_path, egress_buffer_bytes=16 << 20)
    with serving(kind, middleware) as server:
        # 6 MB of events: more than the kernel's socket buffers take (4 MB at most).
        client = open_client(
            server.port, completion_request(server.port, "late", 6000), rcvbuf=STALL_RCVBUF
        )
        wait_until(lambda: app.outcomes.get("cmpl-late") == "finished")  # nobody read yet
        updates = agent.wait_for(
            lambda ms: any(getattr(m, "kv_blocks", 1) == 0 for m in of_kind(ms, Update))
        )
        body = read_all(client)  # the client catches up from the buffer
        client.close()
        assert agent.first(Close, "cmpl-late").reason == "finished"
    assert len(_sse_data(body)) == 6001
    assert not any(u.egress_buffer_full for u in of_kind(updates, Update))
    budget = middleware.egress_budget
    assert budget is not None and budget.buffered_bytes == 0
    assert 0 < budget.peak_bytes <= 16 << 20


@pytest.mark.parametrize("kind", SERVERS)
def test_a_full_egress_buffer_holds_the_app_reports_the_stream_and_stays_bounded(
    kind: str, socket_path: str, agent_factory: AgentFactory, middlewares: Callable[..., Middleware]
) -> None:
    agent = agent_factory()
    app = SseApp(pause=0)
    per_stream, total, pad = 256 * 1024, 384 * 1024, 16 * 1024
    middleware = middlewares(
        app, socket_path, egress_buffer_bytes=per_stream, egress_total_bytes=total
    )
    with serving(kind, middleware) as server:
        clients = [
            open_client(
                server.port,
                completion_request(server.port, f"s{i}", 100_000, pad=pad),
                rcvbuf=STALL_RCVBUF,
            )
            for i in range(3)
        ]
        agent.wait_for(lambda ms: all(_reported_full(ms, f"cmpl-s{i}") for i in range(3)), 15)
        budget = middleware.egress_budget
        assert budget is not None
        event_bytes = pad + 200  # one SSE event of the test app, an upper bound
        assert budget.peak_bytes <= total + 3 * event_bytes
        assert all(app.outcomes[f"cmpl-s{i}"] == "running" for i in range(3))
        agent.send(Cancel(request_id="cmpl-s0", reason="stalled", correlation_id="c-9"))
        assert _answer(agent, "c-9").status == "cancelled"
        for client in clients:
            client.close()  # unread data: a reset; the apps end mid-response
        assert (
            agent.first(Close, "cmpl-s1").reason
            == agent.first(Close, "cmpl-s2").reason
            == "aborted"
        )
        wait_until(lambda: budget.buffered_bytes == 0)  # nothing left behind in memory


def _reported_full(messages: list[Message], request_id: str) -> bool:
    return any(
        isinstance(m, Update) and m.request_id == request_id and m.egress_buffer_full
        for m in messages
    )
