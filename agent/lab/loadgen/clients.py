"""The three kinds of streaming client: healthy, slow (reads K bytes/s) and stalled.

Each request runs on its own TCP connection with raw non-blocking socket I/O on the event
loop, so the client decides exactly when and how much it reads.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvwatch.lab.loadgen.http import (
    ABORT_FINISH_REASONS,
    Endpoint,
    ResponseError,
    ResponseParser,
    SseParser,
    Target,
    build_request,
    parse_chunk,
)
from kvwatch.lab.loadgen.report import ClassStats, Outcome, RequestRecord

SocketAddress = tuple[Any, ...]  # what getaddrinfo returns for AF_INET / AF_INET6
HEALTHY_RECV_BYTES = 64 * 1024
HOLD_POLL_SECONDS = 0.05
ERROR_PAUSE_SECONDS = 0.2
MAX_ERROR_BODY_BYTES = 2048
RESET_ERRNOS = (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)


@dataclass(frozen=True)
class Connection:
    """Where and what to send: the resolved address and the request to build. Each request
    carries X-Request-Id `<class>-<run>-<n>` (e.g. `stalled-3f2a9c-17`), unique per run."""

    family: int
    address: SocketAddress
    target: Target
    path: str
    body: dict[str, Any]
    endpoint: Endpoint
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    counter: itertools.count[int] = field(default_factory=itertools.count)

    def next_request_id(self, client_class: str) -> str:
        return f"{client_class}-{self.run_id}-{next(self.counter)}"

    def request(self, request_id: str) -> bytes:
        return build_request(self.target, "POST", self.path, self.body, request_id)


@dataclass(frozen=True)
class Behaviour:
    """How a client reads: `bytes_per_second` 0 means as fast as it can; a stalling client
    (`stall_after_tokens` > 0) stops reading once it has read that many tokens and keeps the
    connection open, and, with `resume_after_seconds`, reads the rest of its answer that
    long after it stopped (someone who came back). `rcvbuf_bytes` 0 keeps the kernel's
    default."""

    bytes_per_second: int = 0
    stall_after_tokens: int = 0
    resume_after_seconds: float | None = None
    rcvbuf_bytes: int = 0


async def client_loop(
    conn: Connection, stats: ClassStats, behaviour: Behaviour, requests: int | None = None
) -> None:
    """Sends requests one after another until cancelled (the end of the run), or until it
    sent `requests` of them (then it waits for the end)."""
    sent = 0
    while requests is None or sent < requests:
        outcome = await stream_request(conn, stats, behaviour)
        sent += 1
        if outcome == "error":
            await asyncio.sleep(ERROR_PAUSE_SECONDS)  # no hot loop against a failing server
    await asyncio.Event().wait()


async def stream_request(conn: Connection, stats: ClassStats, behaviour: Behaviour) -> Outcome:
    """One streaming request; records its tokens and outcome in `stats`."""
    loop = asyncio.get_running_loop()
    record = stats.begin(loop.time(), conn.next_request_id(stats.name))
    sock = socket.socket(conn.family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        if behaviour.rcvbuf_bytes:  # before connect, so the window scale stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, behaviour.rcvbuf_bytes)
        await loop.sock_connect(sock, conn.address)
        await loop.sock_sendall(sock, conn.request(record.request_id))
        record.outcome = await _read_response(sock, conn, stats, record, behaviour)
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        record.outcome = "reset"
    except OSError as exc:
        record.outcome, record.error = "error", os.strerror(exc.errno) if exc.errno else str(exc)
    except ResponseError as exc:
        record.outcome, record.error = "error", str(exc)
    finally:
        sock.close()
        stats.end(record, loop.time())
    return record.outcome


async def _read_response(
    sock: socket.socket,
    conn: Connection,
    stats: ClassStats,
    record: RequestRecord,
    behaviour: Behaviour,
) -> Outcome:
    loop = asyncio.get_running_loop()
    response, events = ResponseParser(), SseParser()
    recv_bytes = HEALTHY_RECV_BYTES
    if behaviour.bytes_per_second:
        recv_bytes = max(1, min(HEALTHY_RECV_BYTES, behaviour.bytes_per_second // 10))
    done = False
    while not response.complete:
        data = await loop.sock_recv(sock, recv_bytes)
        if not data:
            response.eof()
            break
        body = response.feed(data)
        if response.status is not None and response.status != 200:
            return await _http_error(sock, response, body, record)
        for payload in events.feed(body):
            done = done or _on_event(payload, conn, stats, record)
        stall = behaviour.stall_after_tokens
        if stall and record.tokens >= stall and not done and not record.stopped_at:
            record.stopped_at, record.stopped_tokens = loop.time(), record.tokens
            held = await _hold(sock, record, behaviour.resume_after_seconds)
            if held is not None:
                return held
            record.resumed = True
        if behaviour.bytes_per_second:
            await asyncio.sleep(len(data) / behaviour.bytes_per_second)
    if response.status is None:
        record.error = "the server closed the connection before responding"
        return "error"
    if record.finish_reason in ABORT_FINISH_REASONS:
        return "cancelled"
    return "finished" if done or record.finish_reason else "cancelled"


def _on_event(payload: str, conn: Connection, stats: ClassStats, record: RequestRecord) -> bool:
    """Handles one SSE event; True for the final `[DONE]`."""
    if payload.strip() == "[DONE]":
        return True
    text, finish_reason = parse_chunk(payload, conn.endpoint)
    if text:
        stats.token(record, asyncio.get_running_loop().time())
    if finish_reason:
        record.finish_reason = finish_reason
    return False


async def _http_error(
    sock: socket.socket, response: ResponseParser, body: bytes, record: RequestRecord
) -> Outcome:
    loop = asyncio.get_running_loop()
    while not response.complete and len(body) < MAX_ERROR_BODY_BYTES:
        data = await loop.sock_recv(sock, MAX_ERROR_BODY_BYTES)
        if not data:
            break
        body += response.feed(data)
    text = body[:200].decode("utf-8", errors="replace").strip()
    record.error = f"HTTP {response.status}: {text}" if text else f"HTTP {response.status}"
    return "error"


async def _hold(
    sock: socket.socket, record: RequestRecord, seconds: float | None = None
) -> Outcome | None:
    """Keeps the connection open without reading until the peer resets it, `seconds` pass
    (None: until the run ends) or the run ends; the outcome once the hold ended the request,
    None when the time passed and the client reads on."""
    record.outcome = "stalled"  # what the run's end will find
    deadline = None if seconds is None else asyncio.get_running_loop().time() + seconds
    while deadline is None or asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(HOLD_POLL_SECONDS)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # does not read data
        if code in RESET_ERRNOS:
            record.outcome = "reset"
            return record.outcome
        if code:
            record.error = os.strerror(code)
            record.outcome = "error"
            return record.outcome
    record.outcome = "incomplete"
    return None
