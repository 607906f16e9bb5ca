"""`run_load`: runs healthy, slow and stalled clients against one server for a duration."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.errors import ConfigError, KvwatchError
from kvwatch.lab.loadgen.clients import Behaviour, Connection, SocketAddress, client_loop
from kvwatch.lab.loadgen.http import (
    Endpoint,
    ResponseError,
    ResponseParser,
    Target,
    build_request,
    completion_body,
)
from kvwatch.lab.loadgen.report import CLIENT_CLASSES, ClassStats, ClientClass, LoadReport

MAX_MODELS_BYTES = 1024 * 1024
ProgressCallback = Callable[[LoadReport], None]
# Looks at each class's running measurements (its records too); True ends the run now.
StatsCallback = Callable[[dict[ClientClass, ClassStats]], bool]
# What a server that is not OpenAI-compatible (or not there) makes reading /v1/models raise.
_MODEL_LIST_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    ResponseError,
    ValueError,
    LookupError,
    TypeError,
)


@dataclass(frozen=True)
class LoadPlan:
    """What to run. Healthy clients read as fast as they can; slow ones read
    `slow_bytes_per_second`; stalled ones stop reading after `stall_after_tokens` tokens and
    keep the connection open; with `resume_after_seconds`, `returning` of them (None: all)
    read the rest that long after they stopped, the others never do; each sends
    `stalled_requests` requests (None: one after another to the end). Slow and stalled
    clients set SO_RCVBUF to `rcvbuf_bytes` before connecting (0 keeps the kernel default)
    and ask for `long_max_tokens` (None: `max_tokens`): with the
    kernel's default buffers only a long answer outgrows what the buffers hold, and that is
    the answer a client that stops reading pins. Every client sends its next request when
    one ends.
    `model` None means the first model the server lists at /v1/models."""

    url: str = "http://127.0.0.1:8000"
    healthy: int = 4
    slow: int = 0
    stalled: int = 0
    duration_seconds: float = 10.0
    endpoint: Endpoint = "completions"
    model: str | None = None
    prompt: str = "Tell me a long story about a lighthouse keeper."
    max_tokens: int = 128
    long_max_tokens: int | None = None
    slow_bytes_per_second: int = 2048
    rcvbuf_bytes: int = 4096
    stall_after_tokens: int = 1
    resume_after_seconds: float | None = None
    returning: int | None = None
    stalled_requests: int | None = None
    connect_timeout_seconds: float = 5.0

    def __post_init__(self) -> None:
        Target.parse(self.url)
        for name in ("healthy", "slow", "stalled", "rcvbuf_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative", "pass 0 or more")
        if self.stall_after_tokens < 1:
            raise ConfigError("stall_after_tokens must be positive", "pass 1 or more")
        if self.resume_after_seconds is not None and self.resume_after_seconds < 0:
            raise ConfigError("resume_after_seconds must not be negative", "pass 0 or more")
        if self.returning is not None and not 0 <= self.returning <= self.stalled:
            raise ConfigError("returning must be 0..stalled", f"pass 0 to {self.stalled}")
        if self.stalled_requests is not None and self.stalled_requests < 1:
            raise ConfigError("stalled_requests must be positive", "pass 1 or more, or None")
        if self.long_max_tokens is not None and self.long_max_tokens <= 0:
            raise ConfigError("long_max_tokens must be positive", "pass a number above 0")
        for name in ("duration_seconds", "max_tokens", "slow_bytes_per_second"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", "pass a number above 0")
        if self.healthy + self.slow + self.stalled == 0:
            raise ConfigError("no clients to run", "ask for at least one healthy, slow or stalled")
        if self.endpoint not in ("completions", "chat"):
            raise ConfigError(f"unknown endpoint {self.endpoint!r}", "use completions or chat")

    def max_tokens_of(self, name: ClientClass) -> int:
        if name == "healthy" or self.long_max_tokens is None:
            return self.max_tokens
        return self.long_max_tokens

    def clients(self, name: ClientClass) -> int:
        return {"healthy": self.healthy, "slow": self.slow, "stalled": self.stalled}[name]

    def behaviour(self, name: ClientClass, index: int = 0) -> Behaviour:
        """How the `index`-th client of class `name` reads."""
        if name == "slow":
            return Behaviour(self.slow_bytes_per_second, rcvbuf_bytes=self.rcvbuf_bytes)
        if name == "stalled":
            returns = self.returning is None or index < self.returning
            return Behaviour(
                stall_after_tokens=self.stall_after_tokens,
                resume_after_seconds=self.resume_after_seconds if returns else None,
                rcvbuf_bytes=self.rcvbuf_bytes,
            )
        return Behaviour()


async def run_load(
    plan: LoadPlan,
    on_progress: ProgressCallback | None = None,
    progress_interval_seconds: float = 1.0,
    on_stats: StatsCallback | None = None,
) -> LoadReport:
    """Runs `plan` and reports per class; raises KvwatchError when the server is unreachable.
    Every `progress_interval_seconds`, `on_progress` gets the report so far and `on_stats`
    the measurements themselves, and ends the run early by returning True."""
    loop = asyncio.get_running_loop()
    target = Target.parse(plan.url)
    family, address = await _resolve(target)
    probe = await _connect(target, family, address, plan.connect_timeout_seconds)
    with probe:
        model = plan.model or await _first_model(target, probe, plan.connect_timeout_seconds)
    path = target.path(plan.endpoint)
    conns = {
        name: Connection(
            family,
            address,
            target,
            path,
            completion_body(plan.endpoint, model, plan.prompt, plan.max_tokens_of(name)),
            plan.endpoint,
        )
        for name in CLIENT_CLASSES
    }
    stats = {name: ClassStats(name, plan.clients(name)) for name in CLIENT_CLASSES}
    started = loop.time()

    def snapshot() -> LoadReport:
        elapsed = loop.time() - started
        reports = {name: stats[name].report(elapsed) for name in CLIENT_CLASSES}
        return LoadReport(target.base_url + path, plan.endpoint, model, elapsed, reports)

    tasks = [
        asyncio.create_task(
            client_loop(
                conns[name],
                stats[name],
                plan.behaviour(name, index),
                plan.stalled_requests if name == "stalled" else None,
            )
        )
        for name in CLIENT_CLASSES
        for index in range(plan.clients(name))
    ]
    try:
        deadline = started + plan.duration_seconds
        while (remaining := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait(tasks, timeout=min(remaining, progress_interval_seconds))
            for task in done:
                task.result()  # clients only end by cancellation: anything else is a bug
            if on_progress is not None:
                on_progress(snapshot())
            if on_stats is not None and on_stats(stats):
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return snapshot()


async def _resolve(target: Target) -> tuple[int, SocketAddress]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise KvwatchError(
            f"cannot resolve {target.host}: {exc.strerror}", "check the host name in --url"
        ) from exc
    family, _, _, _, address = infos[0]
    return family, address


async def _connect(
    target: Target, family: int, address: SocketAddress, timeout_seconds: float
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(
            asyncio.get_running_loop().sock_connect(sock, address), timeout_seconds
        )
    except (OSError, asyncio.TimeoutError) as exc:
        sock.close()
        reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else "timed out"
        raise KvwatchError(
            f"cannot reach {target.base_url}: {reason}",
            "start the server, or pass its base URL with --url",
        ) from exc
    return sock


async def _first_model(target: Target, sock: socket.socket, timeout_seconds: float) -> str:
    """The id of the first model GET /v1/models lists."""
    url = target.base_url + target.api_prefix + "/models"
    try:
        body = await asyncio.wait_for(_get(target, sock, "/models"), timeout_seconds)
        models = json.loads(body)["data"]
        model = models[0]["id"]
        if not isinstance(model, str):
            raise ValueError(f"model id {model!r} is not a string")
        return model
    except _MODEL_LIST_ERRORS as exc:
        raise KvwatchError(
            f"could not read a model name from {url}: {exc or type(exc).__name__}",
            "pass the model name with --model",
        ) from exc


async def _get(target: Target, sock: socket.socket, path: str) -> bytes:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, build_request(target, "GET", target.api_prefix + path, None))
    response, body = ResponseParser(), b""
    while not response.complete and len(body) < MAX_MODELS_BYTES:
        data = await loop.sock_recv(sock, 65536)
        if not data:
            response.eof()
            break
        body += response.feed(data)
    if response.status != 200:
        raise ResponseError(f"HTTP {response.status}")
    return body
