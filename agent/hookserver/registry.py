"""What the hook server knows: the live streams engines announced, and its event counters."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvwatch.hookwire.commands import agent_command_counters
from kvwatch.hookwire.counters import EventCounters
from kvwatch.sockets import Endpoint

# Streams one connection may announce, and all connections together: what bounds the memory
# an engine (or anything that says hello) can make the agent hold (docs/protocol.md, "Limits").
DEFAULT_MAX_STREAMS_PER_CONNECTION = 16384
DEFAULT_MAX_STREAMS = 65536
# Server addresses remembered (relay joins ask whether a socket's peer is a hooked engine's).
MAX_SERVER_ENDPOINTS = 1024

COUNTER_NAMES = (
    "connections_accepted",
    "peers_refused",
    "connections_refused_busy",
    "silent_connections_dropped",
    "hello_timeouts",
    "disconnects",
    "hellos",
    "session_resets",
    "malformed_messages",
    "oversized_lines",
    "version_mismatches",
    "before_hello_messages",
    "opens",
    "duplicate_opens",
    "streams_refused",
    "updates",
    "closes",
    "unknown_request_events",
    *agent_command_counters(),
    "resumes",
    "send_overflows",
    "callback_errors",
    "internal_errors",
)

_log = logging.getLogger("kvwatch.hookserver")


@dataclass(frozen=True)
class EngineStream:
    """One live stream an engine announced: the request, its TCP 4-tuple and the KV it holds.

    `local`/`remote` are the server socket's 4-tuple as the engine sees it (what the kernel
    reports for that socket). `engine_pid` is the pid to join on, in the agent's pid namespace;
    `announced_pid` is the `open.pid` as the engine sent it (see `resolve_engine_pid`).
    `opened_ns` is `time.monotonic_ns()` when the agent first learned of the request.
    `kv_estimated` marks `kv_blocks` as the hook's estimate rather than the engine's block
    table; `egress_buffer_full` says the engine's output buffer for it is at its cap.
    `can_park` says its engine can park requests (hello `features`), `parked` that the
    request is parked now: its KV is free, the request and its connection live on;
    `parked_blocks` the blocks its park freed (0 when not parked, or re-announced parked).
    `can_detach` says its engine can detach a stream from its client (hello `features`),
    `detached` that this one is now: its output goes to a host buffer and its generation runs
    on; cleared when an update reports that buffer full (the stream is coupled again).
    `can_pause` says its engine can pause and release requests (hello `features`), `paused`
    that this one is held now: it gets no decode steps (a parked request is paused too).
    """

    request_id: str
    engine_pid: int
    announced_pid: int
    engine: str
    model: str
    device: str
    local: Endpoint
    remote: Endpoint
    kv_blocks: int
    bytes_per_block: int
    tokens_out: int
    opened_ns: int
    kv_estimated: bool = False
    egress_buffer_full: bool = False
    can_park: bool = False
    parked: bool = False
    parked_blocks: int = 0
    can_detach: bool = False
    detached: bool = False
    can_pause: bool = False
    paused: bool = False

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.bytes_per_block


def resolve_engine_pid(peer_pid: int, hello_pid: int, announced_pid: int) -> int:
    """The pid the agent joins a stream on, in the agent's own pid namespace.

    The kernel translates the SO_PEERCRED pid into the agent's pid namespace, while an engine in
    a container only knows its namespace-local pid (often 1). When the hello's pid equals the
    peer pid, both sides share a namespace and `open.pid` is trusted as the socket's owner (the
    protocol allows an engine to announce for a worker process). Otherwise `open.pid` cannot be
    translated, and the peer process (same container, same cgroup) is the best pid there is.
    A peer pid of 0 means the peer's namespace is not visible to the agent at all.
    """
    if peer_pid in (0, hello_pid):
        return announced_pid
    return peer_pid


ChangeCallback = Callable[[str, EngineStream | None], None]
FourTuple = tuple[Endpoint, Endpoint]


class StreamRegistry:
    """Every live stream by request id, which connection owns it, and an index by 4-tuple.

    Owned by the event loop; connections add and remove streams, the server reads them.
    Invariants: a request id has exactly one owner (the connection whose `open` came last); the
    4-tuple index holds exactly the live streams; an owner holds at most `max_per_owner`
    streams and all owners together at most `max_streams` (an `open` beyond is refused and
    counted); `on_change` is called once per change, with the new stream or None when it is
    gone, and an exception it raises is counted and logged, never propagated into a connection.
    """

    def __init__(
        self,
        counters: EventCounters,
        on_change: ChangeCallback | None,
        max_per_owner: int = DEFAULT_MAX_STREAMS_PER_CONNECTION,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        self._counters = counters
        self._on_change = on_change
        self._max_per_owner = max_per_owner
        self._max_streams = max_streams
        self._streams: dict[str, EngineStream] = {}
        self._owner: dict[str, int] = {}
        self._owned: dict[int, dict[str, None]] = {}
        self._by_tuple: dict[FourTuple, dict[str, None]] = {}
        self._servers: dict[Endpoint, None] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def streams(self) -> list[EngineStream]:
        return list(self._streams.values())

    def get(self, request_id: str) -> EngineStream | None:
        return self._streams.get(request_id)

    def owner_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def owned_count(self, owner: int) -> int:
        return len(self._owned.get(owner, ()))

    def find(self, local: Endpoint, remote: Endpoint) -> EngineStream | None:
        """The newest live stream on this 4-tuple (HTTP/2 may carry several), or None."""
        request_ids = self._by_tuple.get((local, remote))
        if not request_ids:
            return None
        return self._streams[next(reversed(request_ids))]

    def serves(self, local: Endpoint) -> bool:
        """Whether some stream announced in this session had `local` as its server address
        (the newest MAX_SERVER_ENDPOINTS addresses are remembered)."""
        return local in self._servers

    def open(self, owner: int, stream: EngineStream) -> bool:
        """Adds the stream; an open for a live request id replaces it (keeping `opened_ns`).
        False (counted in `streams_refused`) when a stream budget is full."""
        previous = self._streams.get(stream.request_id)
        if previous is None and (
            len(self._streams) >= self._max_streams
            or self.owned_count(owner) >= self._max_per_owner
        ):
            self._counters.add("streams_refused")
            return False
        if previous is not None:
            self._counters.add("duplicate_opens")
            self._unlink(stream.request_id, previous)
            stream = dataclasses.replace(stream, opened_ns=previous.opened_ns)
        self._link(owner, stream)
        self._notify(stream.request_id, stream)
        return True

    def update(self, owner: int, request_id: str, **changes: Any) -> bool:
        """New values (EngineStream fields: numbers, parked, detached) for a stream this owner
        announced; False when it owns no such stream."""
        stream = self._streams.get(request_id)
        if stream is None or self._owner[request_id] != owner:
            return False
        stream = dataclasses.replace(stream, **changes)
        self._streams[request_id] = stream
        self._notify(request_id, stream)
        return True

    def remove(self, owner: int, request_id: str) -> bool:
        """Forgets a stream this owner announced; False when it owns no such stream."""
        stream = self._streams.get(request_id)
        if stream is None or self._owner[request_id] != owner:
            return False
        self._unlink(request_id, stream)
        self._notify(request_id, None)
        return True

    def forget_owner(self, owner: int) -> int:
        """Forgets every stream the owner announced (its session ended); returns how many."""
        request_ids = list(self._owned.get(owner, ()))
        for request_id in request_ids:
            self.remove(owner, request_id)
        self._owned.pop(owner, None)
        return len(request_ids)

    def _link(self, owner: int, stream: EngineStream) -> None:
        request_id = stream.request_id
        self._streams[request_id] = stream
        self._owner[request_id] = owner
        self._owned.setdefault(owner, {})[request_id] = None
        self._by_tuple.setdefault((stream.local, stream.remote), {})[request_id] = None
        self._servers.pop(stream.local, None)
        self._servers[stream.local] = None
        if len(self._servers) > MAX_SERVER_ENDPOINTS:
            del self._servers[next(iter(self._servers))]

    def _unlink(self, request_id: str, stream: EngineStream) -> None:
        del self._streams[request_id]
        owner = self._owner.pop(request_id)
        self._owned[owner].pop(request_id, None)
        key = (stream.local, stream.remote)
        on_tuple = self._by_tuple[key]
        on_tuple.pop(request_id, None)
        if not on_tuple:
            del self._by_tuple[key]

    def _notify(self, request_id: str, stream: EngineStream | None) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(request_id, stream)
        except Exception:  # the callback is the daemon's code, but one bug must not end a session
            self._counters.add("callback_errors")
            _log.exception("hook server on_change callback failed for %s", request_id)
