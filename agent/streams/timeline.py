"""Per-stream timelines for `kvwatch explain`: what happened to one connection, in order —
accept, first byte from the engine, first byte to the client, zero-window episodes, stall,
decision, cancel acknowledgement, close — kept live and for a while after the stream ends."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvwatch.sockets import Endpoint, SocketSample

ConnectionId = tuple[str, str]
ENTRIES_PER_STREAM = 128
# Live timelines kept at most; past it the oldest is closed ("evicted"). An engine can announce
# streams on connections the collector never sees, so this, not the socket table, bounds it.
DEFAULT_MAX_LIVE = 32768
# A live timeline whose socket the collector has not seen for this long is closed ("gone"):
# what a close event would have said, for collectors that have none (sock_diag polling) and
# for announced connections that never existed.
UNSEEN_NS = 10_000_000_000
# Sweeps per UNSEEN_NS: enough to close an unseen timeline within a quarter more of it, few
# enough that a node of many live streams does not name every connection at every scan.
SWEEPS_PER_UNSEEN = 4
# Messages about a connection can arrive just after its close (the cancel acknowledgement
# comes after the engine reset the connection); they join the closed timeline.
LATE_EVENTS_NS = 5_000_000_000


def connection_id(local: Endpoint, remote: Endpoint) -> ConnectionId:
    return (str(local), str(remote))


@dataclass
class Timeline:
    """One connection's story. `request_id` is set once an engine announced it."""

    connection: ConnectionId
    request_id: str | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    last_stream: dict[str, Any] | None = None
    closed_ns: int = 0
    seen_ns: int = field(default_factory=time.monotonic_ns)

    @property
    def closed(self) -> bool:
        return self.closed_ns != 0

    def add(self, ts_ns: int, event: str, **detail: Any) -> None:
        if len(self.entries) < ENTRIES_PER_STREAM:
            self.entries.append({"ts_ns": ts_ns, "event": event, **detail})

    def to_json(self) -> dict[str, Any]:
        ordered = sorted(self.entries, key=lambda e: e["ts_ns"])
        start = ordered[0]["ts_ns"] if ordered else 0
        return {
            "request_id": self.request_id,
            "local": self.connection[0],
            "remote": self.connection[1],
            "live": not self.closed,
            "stream": self.last_stream,
            "timeline": [
                {**e, "offset_seconds": round((e["ts_ns"] - start) / 1e9, 6)} for e in ordered
            ],
        }


class Timelines:
    """Live timelines by connection, finished ones by request (the newest `history_size`).
    Owned by the daemon's event loop. Invariants: a connection has at most one live timeline;
    at most `max_live` timelines are live; only timelines of announced requests are kept after
    close; every table is bounded (by `max_live` or `history_size`)."""

    def __init__(self, history_size: int, max_live: int = DEFAULT_MAX_LIVE) -> None:
        self.history_size = history_size
        self.max_live = max_live
        self._live: dict[ConnectionId, Timeline] = {}
        self._by_request: dict[str, ConnectionId] = {}
        self._finished: OrderedDict[str, Timeline] = OrderedDict()
        self._just_closed: OrderedDict[ConnectionId, Timeline] = OrderedDict()
        self._swept_ns = 0

    def of(self, connection: ConnectionId) -> Timeline:
        """The connection's live timeline, the one closed moments ago, or a new one."""
        timeline = self._live.get(connection)
        if timeline is not None:
            return timeline
        recent = self._just_closed.get(connection)
        if recent is not None and time.monotonic_ns() - recent.closed_ns < LATE_EVENTS_NS:
            return recent
        if len(self._live) >= self.max_live:
            oldest = next(iter(self._live))
            self.close(oldest, time.monotonic_ns(), None, event="evicted")
        timeline = self._live[connection] = Timeline(connection)
        return timeline

    def sweep_due(self, now_ns: int) -> bool:
        """Whether a scan should sweep: there are live timelines and the last sweep is
        UNSEEN_NS / SWEEPS_PER_UNSEEN old."""
        return bool(self._live) and now_ns - self._swept_ns >= UNSEEN_NS // SWEEPS_PER_UNSEEN

    def sweep(self, seen: set[ConnectionId], now_ns: int) -> int:
        """Notes which live timelines' sockets the collector sees (`seen`, from a full scan)
        and closes those unseen for UNSEEN_NS; returns how many it closed."""
        self._swept_ns = now_ns
        gone = []
        for connection, timeline in self._live.items():
            if connection in seen:
                timeline.seen_ns = now_ns
            elif now_ns - timeline.seen_ns >= UNSEEN_NS:
                gone.append(connection)
        for connection in gone:
            self.close(connection, now_ns, None, event="gone")
        return len(gone)

    def note_socket(self, sample: SocketSample, ts_ns: int, event: str, **detail: Any) -> None:
        """A socket event; the first one also records accept and first bytes the kernel saw."""
        timeline = self.of(connection_id(sample.local, sample.remote))
        if not _has(timeline, "accepted"):
            timeline.add(sample.first_seen_ns, "accepted")
        if sample.first_send_ns and not _has(timeline, "first_byte_from_engine"):
            timeline.add(sample.first_send_ns, "first_byte_from_engine")
        if sample.first_acked_ns and not _has(timeline, "first_byte_to_client"):
            timeline.add(sample.first_acked_ns, "first_byte_to_client")
        timeline.add(ts_ns, event, **detail)

    def bind(self, connection: ConnectionId, request_id: str, ts_ns: int) -> None:
        if request_id in self._finished:
            return
        timeline = self.of(connection)
        if timeline.request_id != request_id:
            if timeline.request_id is not None:  # the next request on a kept-alive connection
                self._by_request.pop(timeline.request_id, None)
            timeline.request_id = request_id
            self._by_request[request_id] = connection
            timeline.add(ts_ns, "engine_announced", request_id=request_id)

    def close(
        self,
        connection: ConnectionId,
        ts_ns: int,
        stream: dict[str, Any] | None,
        event: str = "closed",
    ) -> None:
        """Ends a live timeline with `event`: "closed" (the kernel said so), "gone" (the
        collector stopped seeing the socket) or "evicted" (too many live timelines)."""
        timeline = self._live.pop(connection, None)
        if timeline is None:
            return
        timeline.add(ts_ns, event)
        timeline.closed_ns = time.monotonic_ns()
        timeline.last_stream = stream or timeline.last_stream
        self._just_closed[connection] = timeline
        while len(self._just_closed) > self.history_size:
            self._just_closed.popitem(last=False)
        if timeline.request_id is None:
            return
        self._by_request.pop(timeline.request_id, None)
        self._finished[timeline.request_id] = timeline
        while len(self._finished) > self.history_size:
            self._finished.popitem(last=False)

    def find(self, request_id: str) -> Timeline | None:
        connection = self._by_request.get(request_id)
        if connection is not None and connection in self._live:
            return self._live[connection]
        return self._finished.get(request_id)

    def find_endpoint(self, endpoint: str) -> Timeline | None:
        """The newest timeline of a connection with `endpoint` ("ip:port") at either end:
        live first, then recently closed, then finished (streams no engine announced are
        kept only among the recently closed)."""
        for timelines in (
            self._live.values(),
            reversed(self._just_closed.values()),
            reversed(self._finished.values()),
        ):
            for timeline in timelines:
                if endpoint in timeline.connection:
                    return timeline
        return None

    def finished_count(self) -> int:
        return len(self._finished)

    def live_count(self) -> int:
        return len(self._live)


def _has(timeline: Timeline, event: str) -> bool:
    return any(entry["event"] == event for entry in timeline.entries)
