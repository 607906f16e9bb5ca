"""Stream states: the agent's vocabulary, exactly as DESIGN.md defines them.

- healthy: data flows; the ACK point advances.
- slow: the send queue is mostly full, or the window touched zero recently, but the ACK point
  still advances.
- zero_window: the peer's window is 0 now, for less than the stall threshold.
- stalled: data is pending, the ACK point has not advanced, and the window is zero or the send
  buffer full — all of it for at least `stall_seconds`. Only this state is ever acted on.
An idle socket (nothing pending) is never stalled; neither is a slow reader that keeps
draining, however often its window closes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvwatch.errors import ConfigError
from kvwatch.sockets import SocketSample

NS_PER_SECOND = 1_000_000_000


class StreamState(str, enum.Enum):
    HEALTHY = "healthy"
    SLOW = "slow"
    ZERO_WINDOW = "zero_window"
    STALLED = "stalled"
    CANCELLED = "cancelled"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StatePolicy:
    """Thresholds of the classifier. `slow_fill` is the send-queue fill that counts as
    "mostly full"; a zero-window episode that ended less than `stall_seconds` ago still
    marks a stream slow."""

    stall_seconds: float = 3.0
    slow_fill: float = 0.75

    def __post_init__(self) -> None:
        if not self.stall_seconds > 0:
            raise ConfigError(
                f"stall_seconds must be > 0, got {self.stall_seconds}",
                "use a threshold such as 3 (seconds)",
            )
        if not 0 < self.slow_fill <= 1:
            raise ConfigError(
                f"slow_fill must be in (0, 1], got {self.slow_fill}", "use a fraction such as 0.75"
            )

    @property
    def stall_ns(self) -> int:
        return int(self.stall_seconds * NS_PER_SECOND)


def pressure_since_ns(sample: SocketSample) -> int:
    """Start of the current back-pressure (zero window or full buffer); 0 when there is none."""
    open_episodes = [t for t in (sample.zero_window_since_ns, sample.sndbuf_full_since_ns) if t]
    return min(open_episodes) if open_episodes else 0


def stall_since_ns(sample: SocketSample) -> int:
    """Since when every stall condition has held at once; 0 when one of them does not."""
    pressure = pressure_since_ns(sample)
    if sample.pending_bytes <= 0 or not pressure:
        return 0
    return max(pressure, sample.progress_ns)


def stall_deadline_ns(sample: SocketSample, policy: StatePolicy) -> int:
    """When the stream becomes stalled if nothing changes; 0 when it is not on its way."""
    since = stall_since_ns(sample)
    return since + policy.stall_ns if since else 0


def classify(sample: SocketSample, now_ns: int, policy: StatePolicy) -> StreamState:
    deadline = stall_deadline_ns(sample, policy)
    if deadline and now_ns >= deadline:
        return StreamState.STALLED
    if sample.zero_window:
        return StreamState.ZERO_WINDOW
    recent_zero_window = (
        sample.last_zero_window_end_ns != 0
        and now_ns - sample.last_zero_window_end_ns < policy.stall_ns
    )
    if sample.sndbuf_full or sample.sndbuf_fill >= policy.slow_fill or recent_zero_window:
        return StreamState.SLOW
    return StreamState.HEALTHY
