"""HTTP servers for the input-hardening tests: the agent's real API app (kvwatch.api.routes)
over a small fake agent, served by the agent's own ApiServer on a thread; and a server that
answers every request with whatever the test sets (garbage, in the fuzz test)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from kvwatch.api.api_server import ApiServer
from kvwatch.api.routes import build_app
from kvwatch.api.state import AgentState
from kvwatch.daemon.preflight import bind_listen_address
from kvwatch.streams.states import StallThresholds
from kvwatch.streams.timeline import Timelines

KNOWN_REQUEST = "cmpl-known"
KNOWN_CONNECTION = ("127.0.0.1:8000", "127.0.0.1:50123")


def fake_agent_state() -> AgentState:
    """An agent with no sockets, no engine, and one finished stream (KNOWN_REQUEST)."""
    timelines = Timelines(history_size=10)
    timelines.bind(KNOWN_CONNECTION, KNOWN_REQUEST, time.monotonic_ns())
    timelines.close(KNOWN_CONNECTION, time.monotonic_ns(), None)
    state = SimpleNamespace(
        mode="observe",
        stall_thresholds=StallThresholds(),
        started_ns=time.monotonic_ns(),
        opened=None,
        bpf=None,
        table=None,
        gpus=SimpleNamespace(available=False),
        hooks=SimpleNamespace(engines=list),
        timelines=timelines,
        samples=list,
        stream_views=list,
        events_after=lambda since: [],
    )
    return cast(AgentState, state)


def agent_app() -> Starlette:
    """The agent's real routes over `fake_agent_state()`."""
    return build_app(fake_agent_state(), CollectorRegistry())


@contextmanager
def served_agent() -> Iterator[str]:
    """The real API app served by the agent's ApiServer on its own thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ApiServer(agent_app(), bind_listen_address("127.0.0.1:0"))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(5)
    try:
        yield f"http://127.0.0.1:{server.address[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@dataclass
class Answer:
    """What the garbage server answers next: a status, a content type and a body."""

    status: int = 200
    content_type: str = "application/json"
    body: bytes = b"{}"
    requests: list[str] = field(default_factory=list)


class _GarbageHandler(BaseHTTPRequestHandler):
    answer: Answer

    def do_GET(self) -> None:
        self.answer.requests.append(self.path)
        self.send_response(self.answer.status)
        self.send_header("Content-Type", self.answer.content_type)
        self.send_header("Content-Length", str(len(self.answer.body)))
        self.end_headers()
        self.wfile.write(self.answer.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def garbage_server() -> Iterator[tuple[str, Answer]]:
    """A server that answers every GET with the `Answer` it yields (change it between
    requests); yields its URL and that answer."""
    answer = Answer()
    handler = type("Handler", (_GarbageHandler,), {"answer": answer})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
