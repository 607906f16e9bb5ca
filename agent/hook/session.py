"""One connection to the agent, driven by the hook's I/O thread until it ends."""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

from kvwatch.errors import ProtocolError
from kvwatch.hook.book import StreamBook
from kvwatch.hook.commands import CommandRunner
from kvwatch.hook.holds import HoldKeeper
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import (
    Answer,
    Command,
    ErrorMessage,
    LineFramer,
    Message,
    Welcome,
    encode,
    plural,
)

SEND_CHUNK_BYTES = 64 * 1024
OUT_LOW_WATER_BYTES = 64 * 1024
RECV_BYTES = 64 * 1024
TAKE_BATCH = 256
MAX_SELECT_SECONDS = 0.5

_log = logging.getLogger("kvwatch.hook")


class Waker:
    """A socketpair that wakes the I/O thread's select; any thread may call `wake`."""

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    def fileno(self) -> int:
        return self._reader.fileno()

    def wake(self) -> None:
        # Full (a wake is already pending) or closed (stopping): both fine.
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while self._reader.recv(4096):
                pass

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


class Session:
    """One connected socket: sends hello + snapshot + queued messages, receives commands.

    Owned by the hook's I/O thread, which calls `run` once; `run` closes the socket, ends the
    book's session and abandons commands in flight before it returns. The socket is non-blocking,
    so a slow agent only ever stalls this thread's output, never an engine thread.
    Invariants: the outbound buffer is refilled from the bounded queue only below
    OUT_LOW_WATER_BYTES, so it stays bounded; when no byte could be written for
    `send_timeout_seconds` while output was pending, the session ends (the next one resyncs).
    """

    def __init__(
        self,
        sock: socket.socket,
        book: StreamBook,
        *,
        commands: CommandRunner,
        holds: HoldKeeper,
        counters: EventCounters,
        waker: Waker,
        stop: threading.Event,
        send_timeout_seconds: float,
    ) -> None:
        self._sock = sock
        self._book = book
        self._commands = commands
        self._holds = holds
        self._counters = counters
        self._waker = waker
        self._stop = stop
        self._send_timeout_seconds = send_timeout_seconds
        self._framer = LineFramer(sender="agent")
        self._out = bytearray()
        self._unsent_line_bytes: deque[int] = deque()
        self._waiting_since = 0.0
        self._events = selectors.EVENT_READ
        # Each command in flight: its stream's resumes when it arrived (StreamBook.answered)
        # and the lease it asks for (HoldKeeper).
        self._arrived: dict[str, tuple[int, int]] = {}

    def run(self) -> str:
        """Serves the connection until it breaks or the hook stops; returns why it ended."""
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._waker, selectors.EVENT_READ)
            selector.register(self._sock, self._events)
            self._queue_messages(self._book.start_session())
            while not self._stop.is_set():
                reason = self._step(selector)
                if reason is not None:
                    return reason
            return "the hook stopped"
        finally:
            selector.close()
            self._book.end_session()
            self._commands.abandon()
            self._holds.release_all()
            self._sock.close()

    def _step(self, selector: selectors.BaseSelector) -> str | None:
        """Sends what is due, then waits for the socket, the waker or the next deadline."""
        now = time.monotonic()
        self._queue_messages(self._commands.poll(now))
        self._holds.expire(now)
        self._refill()
        reason = self._flush(now)
        if reason is not None:
            return reason
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._out else 0)
        if events != self._events:
            selector.modify(self._sock, events)
            self._events = events
        for key, mask in selector.select(self._select_timeout()):
            if key.fileobj is self._waker:
                self._waker.drain()
            elif mask & selectors.EVENT_READ:
                reason = self._receive()
                if reason is not None:
                    return reason
        return None

    def _select_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [now + MAX_SELECT_SECONDS]
        for deadline in self._commands.next_deadline(), self._holds.next_expiry():
            if deadline is not None:
                deadlines.append(deadline)
        if self._out:
            deadlines.append(self._waiting_since + self._send_timeout_seconds)
        return max(0.0, min(deadlines) - now)

    def _receive(self) -> str | None:
        try:
            data = self._sock.recv(RECV_BYTES)
        except BlockingIOError:
            return None
        except OSError as exc:
            return f"receive failed: {exc.strerror or exc}"
        if not data:
            return "the agent closed the connection"
        for item in self._framer.feed(data):
            self._handle(item)
        return None

    def _handle(self, item: Message | ProtocolError) -> None:
        if isinstance(item, ProtocolError):
            self._counters.add("malformed_received")
            _log.debug("dropped a malformed message from the agent: %s", item)
        elif isinstance(item, Command):
            lease_ms = getattr(item, "lease_ms", 0)
            self._arrived[item.correlation_id] = (self._book.resumes_of(item.request_id), lease_ms)
            answer = self._commands.submit(item, time.monotonic())
            if answer is not None:
                self._queue_messages([answer])
        elif isinstance(item, ErrorMessage):
            self._counters.add("agent_errors_received")
            _log.warning("kvwatch agent reports: %s (%s)", item.message, item.hint)
        elif isinstance(item, Welcome):
            _log.info("connected to %s", item.agent)

    def _refill(self) -> None:
        if len(self._out) >= OUT_LOW_WATER_BYTES:
            return
        if not self._out and self._book.needs_resync():
            self._counters.add("resyncs")
            self._queue_messages(self._book.start_session())
        else:
            self._queue_messages(self._book.take(TAKE_BATCH))

    def _queue_messages(self, messages: Sequence[Message]) -> None:
        for message in messages:
            try:
                line = encode(message)
            except ProtocolError as exc:
                self._counters.add("dropped_invalid")
                _log.debug("dropped an unencodable message: %s", exc)
                continue
            if not self._out:
                self._waiting_since = time.monotonic()
            self._out += line
            self._unsent_line_bytes.append(len(line))
            if isinstance(message, Answer):
                self._note_answer(message)

    def _note_answer(self, answer: Answer) -> None:
        """Counts an answer going out; one that took effect marks its stream (park, detach,
        pause, release), and a pause or park that took effect holds the request for its
        lease."""
        self._counters.add(f"{plural(answer.COMMAND)}_answered")
        resumes_then, lease_ms = self._arrived.pop(answer.correlation_id, (0, 0))
        live = self._book.answered(answer.request_id, answer.status, resumes_then)
        if answer.status in ("paused", "parked") and live:
            self._holds.hold(answer.request_id, lease_ms, time.monotonic())
        elif answer.status in ("released", "detached"):  # a detach ends a pause too
            self._holds.drop(answer.request_id)

    def _flush(self, now: float) -> str | None:
        while self._out:
            try:
                sent_bytes = self._sock.send(self._out[:SEND_CHUNK_BYTES], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                break
            except OSError as exc:
                return f"send failed: {exc.strerror or exc}"
            del self._out[:sent_bytes]
            self._waiting_since = now
            self._count_sent(sent_bytes)
        if self._out and now - self._waiting_since >= self._send_timeout_seconds:
            self._counters.add("send_timeouts")
            return f"the agent read nothing for {self._send_timeout_seconds:g} s"
        return None

    def _count_sent(self, sent_bytes: int) -> None:
        """Counts the lines whose last byte just left the buffer."""
        while sent_bytes and self._unsent_line_bytes:
            head = self._unsent_line_bytes[0]
            if head > sent_bytes:
                self._unsent_line_bytes[0] = head - sent_bytes
                return
            sent_bytes -= head
            self._unsent_line_bytes.popleft()
            self._counters.add("sent")
