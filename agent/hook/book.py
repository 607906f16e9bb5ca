"""The hook's shared state: live streams, the bounded outbound queue and the counters."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.hookwire.commands import engine_command_counters
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import Close, EngineInfo, Message, Open, Resumed, Update
from kvwatch.sockets import Endpoint

COUNTER_NAMES = (
    "sent",
    "dropped_queue_full",
    "dropped_invalid",
    "unknown_stream_events",
    "connects",
    "reconnects",
    "connect_failures",
    "disconnects",
    "send_timeouts",
    "resyncs",
    *engine_command_counters(),
    "resumes",
    "lease_expiries",
    "releases_without_agent",
    "malformed_received",
    "agent_errors_received",
    "internal_errors",
)


@dataclass
class _LiveStream:
    local: Endpoint
    remote: Endpoint
    kv_blocks: int
    tokens_out: int
    kv_estimated: bool
    opened_at: float  # time.monotonic() when the engine announced it
    egress_buffer_full: bool = False
    parked: bool = False
    resumes: int = 0
    detached: bool = False
    paused: bool = False


@dataclass(frozen=True)
class _PendingUpdate:
    """A queued "send this stream's current numbers"; several updates coalesce into one. It
    holds the stream itself, so that a stream closed before the update is taken still sends
    its last numbers ahead of its close."""

    request_id: str
    stream: _LiveStream


class StreamBook:
    """The engine's live streams and the messages waiting for the agent connection.

    Engine threads call `opened`/`updated`/`closed`; the hook's I/O thread calls
    `start_session`, `end_session`, `take` and `needs_resync`. One lock guards all of it and is
    never held during I/O, so engine threads never wait on the agent.
    Invariants: the queue holds at most `queue_size` items; at most one pending update per
    stream is queued (it reads the stream's numbers when taken); nothing is queued outside a
    session, because each session starts with a hello and a snapshot of every live stream.
    A drop marks the book for a resync (a fresh hello + snapshot once the queue drains), so the
    agent's view converges again after any loss.
    """

    def __init__(
        self, info: EngineInfo, queue_size: int, counters: EventCounters, wake: Callable[[], None]
    ) -> None:
        self._hello = info
        self._queue_size = queue_size
        self._counters = counters
        self._wake = wake
        self._lock = threading.Lock()
        self._streams: dict[str, _LiveStream] = {}
        self._queue: deque[Message | _PendingUpdate] = deque()
        self._update_queued: set[str] = set()
        self._in_session = False
        self._resync_needed = False

    @property
    def live_count(self) -> int:
        return len(self._streams)

    def opened(
        self,
        request_id: str,
        local: Endpoint,
        remote: Endpoint,
        kv_blocks: int,
        kv_estimated: bool = False,
    ) -> None:
        stream = _LiveStream(local, remote, kv_blocks, 0, kv_estimated, time.monotonic())
        message = self._open_message(request_id, stream)  # validates before anything changes
        with self._lock:
            self._streams[request_id] = stream
            self._enqueue(message)

    def updated(
        self, request_id: str, kv_blocks: int, tokens_out: int, egress_buffer_full: bool = False
    ) -> bool:
        """Records the new numbers; False when the stream is not live."""
        Update(  # validates
            request_id=request_id,
            kv_blocks=kv_blocks,
            tokens_out=tokens_out,
            egress_buffer_full=egress_buffer_full,
        )
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return False
            stream.kv_blocks, stream.tokens_out = kv_blocks, tokens_out
            stream.egress_buffer_full = egress_buffer_full
            stream.detached = stream.detached and not egress_buffer_full  # coupled again
            self._queue_update(request_id)
            return True

    def resumes_of(self, request_id: str) -> int:
        """How often the stream has resumed: taken when a command arrives, so that its
        answer can tell whether the request resumed meanwhile (`answered`)."""
        with self._lock:
            stream = self._streams.get(request_id)
            return stream.resumes if stream is not None else 0

    def answered(self, request_id: str, status: str, resumes_then: int) -> bool:
        """A command's answer is on its way: "parked", "detached" or "paused" marks the
        stream (and "released" unmarks a pause) so that updates and a re-announce say so; a
        park that took effect holds no KV (an update says so, for an engine that cannot).
        A park answered after the request already resumed (its client read at once;
        `resumes_then` is `resumes_of` when the park arrived) and a detach answered after the
        stream's buffer was reported full (coupled again meanwhile) mark nothing. False when
        the stream is not live."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return False
            if status == "parked":
                stream.parked = stream.resumes == resumes_then
                if stream.parked and stream.kv_blocks:  # its KV is free now, whoever says
                    stream.kv_blocks = 0
                    self._queue_update(request_id)
            elif status == "detached":  # a detach ends a pause: the generation runs on
                stream.detached = not stream.egress_buffer_full
                stream.paused = False
            elif status in ("paused", "released"):
                stream.paused = status == "paused"
            return True

    def unpaused(self, request_id: str) -> None:
        """The hook released the request itself (its lease ran out, or the agent went away):
        queues an update that says it is no longer paused."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or not stream.paused:
                return
            stream.paused = False
            self._queue_update(request_id)

    def _queue_update(self, request_id: str) -> None:
        """Queues an update of the live stream's current numbers (lock held), once."""
        if request_id in self._update_queued:
            return
        if self._enqueue(_PendingUpdate(request_id, self._streams[request_id])):
            self._update_queued.add(request_id)

    def resumed(self, request_id: str, kv_blocks: int, recomputed_tokens: int) -> bool:
        """The parked request runs again; queues its `resumed`. False when it is not live."""
        message = Resumed(
            request_id=request_id, kv_blocks=kv_blocks, recomputed_tokens=recomputed_tokens
        )
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return False
            stream.parked, stream.kv_blocks = False, kv_blocks
            stream.resumes += 1
            self._enqueue(message)
            return True

    def closed(self, request_id: str, reason: str) -> bool:
        """Forgets the stream and queues its close; False when it was not live."""
        message = Close(request_id=request_id, reason=reason)
        with self._lock:
            if self._streams.pop(request_id, None) is None:
                return False
            self._update_queued.discard(request_id)  # a queued one still sends the last numbers
            self._enqueue(message)
            return True

    def start_session(self) -> list[Message]:
        """EngineInfo and one open per live stream; replaces whatever was queued, atomically."""
        with self._lock:
            self._queue.clear()
            self._update_queued.clear()
            self._in_session = True
            self._resync_needed = False
            opens = [self._open_message(rid, stream) for rid, stream in self._streams.items()]
        return [self._hello, *opens]

    def end_session(self) -> None:
        with self._lock:
            self._in_session = False
            self._queue.clear()
            self._update_queued.clear()

    def needs_resync(self) -> bool:
        """True once messages were dropped and the queue has drained since."""
        with self._lock:
            return self._resync_needed and not self._queue

    def take(self, limit: int) -> list[Message]:
        """Up to `limit` queued messages, oldest first, with coalesced updates filled in."""
        messages: list[Message] = []
        with self._lock:
            while self._queue and len(messages) < limit:
                item = self._queue.popleft()
                if isinstance(item, Message):
                    messages.append(item)
                    continue
                stream = item.stream
                if self._streams.get(item.request_id) is stream:
                    self._update_queued.discard(item.request_id)
                messages.append(
                    Update(
                        request_id=item.request_id,
                        kv_blocks=stream.kv_blocks,
                        tokens_out=stream.tokens_out,
                        kv_estimated=stream.kv_estimated,
                        egress_buffer_full=stream.egress_buffer_full,
                        paused=stream.paused,
                    )
                )
        return messages

    def _enqueue(self, item: Message | _PendingUpdate) -> bool:
        """Queues `item` (lock held); False when outside a session or dropped because full."""
        if not self._in_session:
            return False
        if len(self._queue) >= self._queue_size:
            self._counters.add("dropped_queue_full")
            self._resync_needed = True
            return False
        self._queue.append(item)
        if len(self._queue) == 1:
            self._wake()
        return True

    def _open_message(self, request_id: str, stream: _LiveStream) -> Open:
        return Open(
            request_id=request_id,
            local=stream.local,
            remote=stream.remote,
            pid=self._hello.pid,
            kv_blocks=stream.kv_blocks,
            bytes_per_block=self._hello.bytes_per_block,
            device=self._hello.device,
            tokens_out=stream.tokens_out,
            kv_estimated=stream.kv_estimated,
            age_ms=int((time.monotonic() - stream.opened_at) * 1000),
            parked=stream.parked,
            detached=stream.detached,
            paused=stream.paused,
        )
