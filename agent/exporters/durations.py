"""How long zero-window episodes and stalls last: two histograms the daemon feeds as episodes
end, and the streams collector yields at each scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import Metric

BUCKETS_SECONDS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 120, 300, 600)


class EpisodeDurations:
    """Owned by the daemon's event loop, which alone observes; scrapes only read."""

    def __init__(self) -> None:
        self._zero_window = Histogram(
            "kvwatch_stream_zero_window_duration_seconds",
            "Length of zero-window episodes of tracked sockets, in seconds.",
            buckets=BUCKETS_SECONDS,
            registry=None,
        )
        self._stall = Histogram(
            "kvwatch_stream_stall_duration_seconds",
            "Length of stalls (from the start of the stall conditions to their end), in seconds.",
            buckets=BUCKETS_SECONDS,
            registry=None,
        )

    def zero_window_ended(self, seconds: float) -> None:
        self._zero_window.observe(seconds)

    def stall_ended(self, seconds: float) -> None:
        self._stall.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        yield from self._zero_window.collect()
        yield from self._stall.collect()
