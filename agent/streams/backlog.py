"""A reader's unread backlog, as the server's kernel shows it (docs/collector.md, "What the
server sees of a reader that stops").

What a stream's reader has not read yet lies in three places the server can see: its own
send queue (`notsent_bytes`), the network (`unacked_bytes`), and the reader's receive buffer,
which shows as the shortfall of the window it advertises now against the largest window it
ever advertised (a reader that keeps up reopens its window to that size; one that stopped
fills it). The sum, in bytes and in seconds of the stream's own output, is the backlog.

Its error: a receiver whose window is still growing (autotuning, the first seconds of a
connection) shows less shortfall than it holds; a receiver fed many small segments grows its
buffer instead of closing its window (Linux's truesize clamp) and hides what it holds until
the buffer reaches its limit; window scaling rounds the window down by up to 2^scale bytes;
after a read, Linux sends the reopened window only once it has grown enough
(tcp_cleanup_rbuf), so a reader that read may show a few segments of shortfall until its
next ACK. The engine's own user-space buffers are not seen at all.

A receiver's window can also come back smaller than the largest it ever advertised: Linux
lowers a receive buffer's window threshold when the buffer filled (tcp_clamp_window) and grows
it back only as data arrives in segments with little overhead, which small writes on loopback
(64 KB MSS) are not. Against the largest window, such a reader looks 85-95 KB behind with
nothing unread, and a held stream sends nothing that could grow the window again: it would be
held for good. So, while a stream is held, a window that rose (its reader read) and then stays
the same for WINDOW_STEADY_NS becomes the reader's ceiling, the size it reopens to now; a
larger window raises it again. A reader that read some and stopped looks caught up too: it is
released, falls behind again and is held again; never the other way round.

A reader that is reading (its right edge, bytes acknowledged plus window, moved forward in
the last READING_NS) can also show a window below its largest with nothing unread: the
receiver lowers the window it offers as its bookkeeping of small segments grows (measured:
11-12 KB of 101 KB behind haproxy on a busy engine, 25 KB of 415 KB over a 50 ms link with
1% loss, readers that read everything). While it reads, a shortfall up to
1 / READING_SHORTFALL_SHARE of its ceiling is not counted; a reader that stopped moves its
right edge no more, and is counted whole READING_NS after its last read.

`FlowMeter` measures each socket's output rate from its kernel counters (bytes acknowledged
plus bytes pending: what the server wrote), while its stream is not held, so the seconds stay
those of the stream's own pace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwatch.sockets import Endpoint, SocketSample

NS_PER_SECOND = 1_000_000_000
# A rate is measured over at least this long, and weighs its newest span this much.
RATE_SPAN_NS = 500_000_000
RATE_WEIGHT = 0.5
# A held stream's window that rose and then kept still this long is its reader's ceiling. Two
# window probes (1 s apart) see it; on loopback a slow reader's window moves in 64 KB steps,
# so a reader still reading may pass for caught up (it is released, and held again if behind).
WINDOW_STEADY_NS = 2 * NS_PER_SECOND
# A reader whose right edge moved within this is reading; while it reads, a window shortfall up
# to 1 / READING_SHORTFALL_SHARE of its ceiling is the receiver's bookkeeping, not unread bytes.
READING_NS = 1_500_000_000
READING_SHORTFALL_SHARE = 8
# Below this output rate (bytes per second) a backlog's seconds are shown as unknown: the rate
# of a stream that stopped writing decays towards 0, and its backlog of 200 KB read as 2.7e11 s.
SHOWN_RATE_FLOOR = 1.0


@dataclass(frozen=True)
class Backlog:
    """One socket's unread backlog: `window_shortfall` (in the reader's receive buffer),
    `in_flight` (sent, not acknowledged) and `unsent` (in the server's send queue), in bytes;
    `rate` the stream's output in bytes per second (0: not measured yet)."""

    window_shortfall: int
    in_flight: int
    unsent: int
    rate: float

    @property
    def bytes(self) -> int:
        return self.window_shortfall + self.in_flight + self.unsent

    @property
    def seconds(self) -> float | None:
        """The backlog in seconds of the stream's output; None while its rate is unknown."""
        return self.bytes / self.rate if self.rate > 0 else None

    def to_json(self) -> dict[str, Any]:
        seconds = self.seconds if self.rate >= SHOWN_RATE_FLOOR else None
        return {
            "bytes": self.bytes,
            "seconds": round(seconds, 3) if seconds is not None else None,
            "window_shortfall_bytes": self.window_shortfall,
            "in_flight_bytes": self.in_flight,
            "unsent_bytes": self.unsent,
            "rate_bytes_per_second": round(self.rate, 1),
        }


def window_shortfall(sample: SocketSample, largest_window: int) -> int:
    """How far the peer's window is below the largest it advertised (0 when unknown)."""
    if sample.peer_rwnd < 0 or largest_window <= 0:
        return 0
    return max(0, largest_window - sample.peer_rwnd)


def backlog_of(sample: SocketSample, rate: float = 0.0) -> Backlog:
    """The backlog of one sample alone: its window against the largest its peer advertised
    (known from BPF only), at `rate` (0: the seconds are unknown)."""
    return Backlog(
        window_shortfall(sample, sample.peer_rwnd_max),
        sample.unacked_bytes,
        sample.notsent_bytes,
        rate,
    )


@dataclass
class _Flow:
    """What the meter keeps of one socket: its last point (when, bytes written), the rate
    measured so far, the largest window its peer advertised (for sources that do not
    report it), and its newest sample; the ceiling its reader reopens to now (None: the
    largest window), and, while held, the lowest window seen and the window last seen
    changing (its size, since when)."""

    point_ns: int
    written: int
    latest: SocketSample
    rate: float = 0.0
    largest_window: int = 0
    ceiling: int | None = None
    held_low: int | None = None
    steady_window: int = -1
    steady_since_ns: int = 0
    right_edge: int = 0
    edge_moved_ns: int = 0

    def note_right_edge(self, sample: SocketSample) -> None:
        """Notes when the reader's right edge last moved."""
        edge = right_edge(sample)
        if edge > self.right_edge:
            self.right_edge, self.edge_moved_ns = edge, sample.observed_ns

    def reading(self, now_ns: int) -> bool:
        return bool(self.edge_moved_ns) and now_ns - self.edge_moved_ns <= READING_NS

    def note_window(self, sample: SocketSample, held: bool) -> None:
        """Follows the window for the ceiling (see the module docstring)."""
        window = sample.peer_rwnd
        self.largest_window = max(self.largest_window, window)
        if self.ceiling is not None and window > self.ceiling:
            self.ceiling = window
        if not held:
            self.held_low = None
            return
        if self.held_low is None or window < self.held_low:
            self.held_low = window
        if window != self.steady_window:
            self.steady_window, self.steady_since_ns = window, sample.observed_ns
            return
        rose = window > self.held_low
        steady = sample.observed_ns - self.steady_since_ns >= WINDOW_STEADY_NS
        if rose and steady and not sample.unacked_bytes:
            self.ceiling = window


def right_edge(sample: SocketSample) -> int:
    """How far the reader lets the server send: bytes acknowledged plus its window."""
    return sample.bytes_acked + max(sample.peer_rwnd, 0)


def written_bytes(sample: SocketSample) -> int:
    """What the server has written on the connection: acknowledged plus pending."""
    return sample.bytes_acked + sample.pending_bytes


class FlowMeter:
    """Output rates and backlogs of the sockets the daemon looks at; owned by its event loop.
    Bounded by the socket table: `forget` drops a socket that closed or left it."""

    def __init__(self) -> None:
        self._flows: dict[int, _Flow] = {}
        self._keys: dict[tuple[Endpoint, Endpoint], int] = {}

    def __len__(self) -> int:
        return len(self._flows)

    def note(self, sample: SocketSample, held: bool = False) -> None:
        """Takes in a fresh look at a socket. While its stream is `held` (paused or parked)
        its rate is kept as it was: a held stream writes nothing because it was told not to."""
        flow = self._flows.get(sample.key)
        written = written_bytes(sample)
        if flow is None or written < flow.written:  # new, or a reused socket key
            self._flows[sample.key] = _Flow(
                sample.observed_ns,
                written,
                sample,
                0.0,
                sample.peer_rwnd,
                right_edge=right_edge(sample),
            )
            self._keys[(sample.local, sample.remote)] = sample.key
            return
        if sample.observed_ns >= flow.latest.observed_ns:
            flow.latest = sample
        flow.note_window(sample, held)
        flow.note_right_edge(sample)
        span_ns = sample.observed_ns - flow.point_ns
        if span_ns < RATE_SPAN_NS:
            return
        if not held:
            rate = (written - flow.written) * NS_PER_SECOND / span_ns
            flow.rate = (
                rate if flow.rate == 0 else RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * flow.rate
            )
        flow.point_ns, flow.written = sample.observed_ns, written

    def backlog(self, sample: SocketSample) -> Backlog:
        """The socket's backlog now (see the module docstring)."""
        flow = self._flows.get(sample.key)
        if flow is None:
            ceiling = sample.peer_rwnd_max
        elif flow.ceiling is None:
            ceiling = max(sample.peer_rwnd_max, flow.largest_window)
        else:
            ceiling = flow.ceiling
        shortfall = window_shortfall(sample, ceiling)
        if flow is not None and flow.reading(sample.observed_ns):
            shortfall = max(0, shortfall - ceiling // READING_SHORTFALL_SHARE)
        return Backlog(
            window_shortfall=shortfall,
            in_flight=sample.unacked_bytes,
            unsent=sample.notsent_bytes,
            rate=flow.rate if flow is not None else 0.0,
        )

    def unread_tokens(self, local: Endpoint, remote: Endpoint, tokens_out: int) -> int | None:
        """Of a stream that wrote `tokens_out` tokens on this connection, how many its reader
        had not read at its newest look: its backlog in the stream's bytes per token (what
        the connection carried per token, headers and earlier requests on it included); None
        when the meter never looked at the connection."""
        key = self._keys.get((local, remote))
        flow = self._flows.get(key) if key is not None else None
        if flow is None or tokens_out <= 0:
            return None
        written = written_bytes(flow.latest)
        unread = self.backlog(flow.latest).bytes
        return min(tokens_out, round(unread * tokens_out / written)) if written else None

    def forget(self, key: int) -> None:
        flow = self._flows.pop(key, None)
        if flow is not None:
            self._keys.pop((flow.latest.local, flow.latest.remote), None)
