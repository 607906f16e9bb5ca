"""Fixtures for the hook tests: a short socket path, real agents, started hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwatch.hook import CommandHandler, CommandOutcome, EngineHook
from kvwatch.hook.asgi import Middleware
from kvwatch.lab.agent_thread import HookServerThread
from kvwatch.lab.asgi_servers import SseApp
from tests.hook.hook_agent import ENGINE_INFO, AgentServer


@pytest.fixture
def agent_factory(socket_path: str) -> Iterator[Callable[..., AgentServer]]:
    agents: list[AgentServer] = []

    def start(*, reading: bool = True) -> AgentServer:
        agent = AgentServer(socket_path, reading=reading)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()


@pytest.fixture
def hook_server(socket_path: str) -> Iterator[HookServerThread]:
    """kvwatch's real HookServer on the test's socket path, on a thread of its own."""
    server = HookServerThread(socket_path)
    yield server
    server.close()


def default_handler(request_id: str, reason: str) -> CommandOutcome:
    return CommandOutcome(request_id, "unknown_request", 0, 0, detail=f"no request ({reason})")


@pytest.fixture
def hook_factory(socket_path: str) -> Iterator[Callable[..., EngineHook]]:
    """Builds started hooks on the test socket path with fast timings; stops them afterwards."""
    hooks: list[EngineHook] = []

    def build(
        handler: CommandHandler = default_handler,
        *,
        queue_size: int = 1024,
        send_timeout_seconds: float = 5.0,
        cancel_timeout_seconds: float = 5.0,
    ) -> EngineHook:
        hook = EngineHook(
            ENGINE_INFO,
            handler,
            socket_path,
            queue_size=queue_size,
            reconnect_seconds=0.2,
            send_timeout_seconds=send_timeout_seconds,
            cancel_timeout_seconds=cancel_timeout_seconds,
        )
        hook.start()
        hooks.append(hook)
        return hook

    yield build
    for hook in hooks:
        hook.stop()


@pytest.fixture
def middlewares(socket_path: str) -> Iterator[Callable[..., Middleware]]:
    """Builds the ASGI middleware around an app, on the test's hook socket (1000 bytes of KV a
    token, quick reconnects), and closes every one at teardown."""
    built: list[Middleware] = []

    def build(app: SseApp, **options: Any) -> Middleware:
        middleware = Middleware(
            app.app, socket_path=socket_path, bytes_per_token=1000, reconnect_seconds=0.2, **options
        )
        built.append(middleware)
        return middleware

    yield build
    for middleware in built:
        middleware.close()
