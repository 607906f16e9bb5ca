"""Stream states: the agent's vocabulary (docs/collector.md).

- healthy: data flows; the ACK point advances.
- slow: the send queue is mostly full, or the window touched zero recently, but the ACK point
  still advances.
- zero_window: the peer's window is 0 now, for less than the stall threshold.
- stalled: data is pending, the ACK point has not advanced, and the window is zero or the send
  buffer full — all of it for at least `stall_seconds`, and, behind a zero window, until the
  kernel has shown that a reader draining `min_reader_bytes_per_second` would have moved by
  now (`judge`). Only this state is ever acted on.
- closed: the application closed its sending side (close() or shutdown(SHUT_WR)); the kernel
  drains what was queued. Never stalled: nothing waits on it; an orphan (no process holds it
  any more) has no request and no KV behind it.
An idle socket (nothing pending) is never stalled; neither is a slow reader that keeps
draining, however often its window closes.

`judge` is the one place a stall is decided; everything else (the classifier, the stall
timers, the policy, the views) reads its `StallJudgement`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvwatch.collect.probes import NS_PER_SECOND, answer_after_ns, probe_base_ns
from kvwatch.config.schema import DEFAULT_MIN_READER_BYTES_PER_SECOND, PolicyConfig
from kvwatch.sockets import SocketSample

# The largest window a peer can advertise without window scaling (RFC 7323).
UNSCALED_WINDOW_MAX = 65535
# What a peer may hold unread, in multiples of the largest window it advertised (see
# peer_buffer_bytes and docs/collector.md).
PEER_BUFFER_PER_WINDOW = 2
# How often a stall whose proof is due is looked at again until the proof comes.
PROOF_POLL_NS = 250_000_000


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
class StallThresholds:
    """The judge's thresholds: what makes a stall. `stall_seconds` is the shortest stall
    ever acted on; `min_reader_bytes_per_second` the reader rate that is guaranteed never to
    be called stalled; `slow_fill` the send-queue fill that counts as "mostly full". A
    zero-window episode that ended less than `stall_seconds` ago still marks a stream slow.
    Built from the `[policy]` settings by `of_policy`, whose bounds the config checks
    (kvwatch.config.schema.RANGES): the one place they are checked."""

    stall_seconds: float = 3.0
    min_reader_bytes_per_second: int = DEFAULT_MIN_READER_BYTES_PER_SECOND
    slow_fill: float = 0.75

    @property
    def stall_ns(self) -> int:
        return int(self.stall_seconds * NS_PER_SECOND)

    @classmethod
    def of_policy(cls, policy: PolicyConfig) -> StallThresholds:
        """The judge's thresholds from the `[policy]` settings of the same names."""
        return cls(
            stall_seconds=policy.stall_seconds,
            min_reader_bytes_per_second=policy.min_reader_bytes_per_second,
        )


def pressure_since_ns(sample: SocketSample) -> int:
    """Start of the current back-pressure (zero window or full buffer); 0 when there is none."""
    open_episodes = [t for t in (sample.zero_window_since_ns, sample.sndbuf_full_since_ns) if t]
    return min(open_episodes) if open_episodes else 0


def stall_since_ns(sample: SocketSample) -> int:
    """Since when every stall condition has held at once; 0 when one of them does not. A
    socket whose sender has closed never stalls: no writer waits on it and no request is
    behind it (the server finished and closed; the kernel drains the rest)."""
    pressure = pressure_since_ns(sample)
    if sample.pending_bytes <= 0 or not pressure or sample.sender_closed:
        return 0
    return max(pressure, sample.progress_ns)


def peer_buffer_bytes(sample: SocketSample) -> int:
    """How much a live reader may have to drain before its window reopens: never more than
    it acknowledged; else `PEER_BUFFER_PER_WINDOW` times the largest window it advertised
    (measured: a receiver holds up to twice its largest window unread, and Linux reopens once
    a sixteenth of its buffer is free); where that is unknown (sock_diag), the largest window
    its window scale allows."""
    if sample.peer_rwnd_max > 0:
        window = PEER_BUFFER_PER_WINDOW * sample.peer_rwnd_max
    elif sample.peer_wscale >= 0:
        window = UNSCALED_WINDOW_MAX << sample.peer_wscale
    else:
        return sample.bytes_acked
    return min(sample.bytes_acked, window)


@dataclass(frozen=True)
class StallJudgement:
    """The verdict on one socket at `now_ns`, with the numbers behind it.

    `since_ns` is when every stall condition began to hold (0: they do not). `required_ns` is
    how long they must hold before the socket is stalled, counted from `since_ns`: at least
    `stall_seconds`, and until the kernel has shown that a reader draining the guaranteed
    rate would have moved: such a reader has emptied its buffer by `drained_ns`, and the
    first zero-window probe (or retransmission) after that reopens the flow: the answer to
    it is due `required_ns` after `since_ns` at the latest. `proof` says how the kernel has
    shown it ("" while it has not): "answer", a segment from the peer after `drained_ns` and
    still no ACK progress; or "silence", no answer to the two probes sent after the peer's
    newest segment (it is gone, not slow; this can come before `required_ns`). `basis`
    names the pressure: "zero_window", or "sndbuf_full" (a window too small for a segment,
    or no ACK at all). `recheck_ns` is when the verdict can next change without a new
    observation (0: only a new observation changes it).
    """

    since_ns: int
    required_ns: int
    stalled: bool
    proof: str
    recheck_ns: int
    basis: str
    buffer_bytes: int = 0
    drained_ns: int = 0

    @property
    def on_the_way(self) -> bool:
        return self.since_ns != 0

    def stalled_seconds(self, now_ns: int) -> float:
        return max(0.0, (now_ns - self.since_ns) / NS_PER_SECOND) if self.since_ns else 0.0

    def evidence(self, thresholds: StallThresholds) -> dict[str, Any]:
        """What the verdict rests on, for `sockets --json`, the audit log and `explain`."""
        if not self.since_ns:
            return {"basis": self.basis}
        return {
            "basis": self.basis,
            "stall_seconds": thresholds.stall_seconds,
            "proof": self.proof or None,
            "min_reader_bytes_per_second": thresholds.min_reader_bytes_per_second,
            "peer_buffer_bytes": self.buffer_bytes,
            "drain_seconds": round(self.buffer_bytes / thresholds.min_reader_bytes_per_second, 3),
        }


NOT_STALLING = StallJudgement(0, 0, False, "", 0, "none")


def judge(sample: SocketSample, now_ns: int, thresholds: StallThresholds) -> StallJudgement:
    """The one judge of a stall (see `StallJudgement` and docs/collector.md)."""
    since = stall_since_ns(sample)
    if not since:
        return NOT_STALLING
    threshold_ns = since + thresholds.stall_ns
    buffer_bytes = peer_buffer_bytes(sample)
    rate = thresholds.min_reader_bytes_per_second
    drained_ns = sample.progress_ns + buffer_bytes * NS_PER_SECOND // rate
    # Probes (zero window) or retransmissions (no ACK) back off from the newest answer, with
    # the kernel's backoff then; before any answer, from the episode's start.
    start_ns = sample.zero_window_since_ns or since
    heard_ns = max(sample.last_ack_ns, since)
    anchor_ns, backoff = (
        (sample.last_ack_ns, sample.probe_backoff)
        if sample.last_ack_ns >= start_ns
        else (start_ns, 0)
    )
    base_ns, rtt_ns = probe_base_ns(sample.rto_us), sample.srtt_us * 1000
    schedule = (anchor_ns, backoff, base_ns, rtt_ns)
    # Silence: no answer to the two probes sent after the newest sign of life.
    _, first_after_heard = answer_after_ns(*schedule, heard_ns + 1)
    _, silent_ns = answer_after_ns(*schedule, first_after_heard + 1)
    answered = sample.last_ack_ns >= drained_ns
    earliest_ns, expected_ns = answer_after_ns(*schedule, drained_ns)
    if answered:
        earliest_ns = expected_ns = sample.last_ack_ns
    silent = now_ns >= silent_ns + PROOF_POLL_NS
    stalled = (answered or silent) and now_ns >= threshold_ns
    # Looked at from the earliest the proving answer can come, then every PROOF_POLL_NS:
    # the decision follows the answer within that.
    proof_ns = max(threshold_ns, min(earliest_ns, silent_ns + PROOF_POLL_NS))
    if stalled:
        recheck_ns = 0
    elif now_ns < proof_ns:
        recheck_ns = proof_ns
    else:
        recheck_ns = now_ns + PROOF_POLL_NS
    basis = "zero_window" if sample.zero_window else "sndbuf_full"
    proof = "answer" if answered else "silence" if silent else ""
    required_ns = max(threshold_ns, expected_ns) - since
    return StallJudgement(
        since, required_ns, stalled, proof, recheck_ns, basis, buffer_bytes, drained_ns
    )


def classify(sample: SocketSample, now_ns: int, thresholds: StallThresholds) -> StreamState:
    return state_of(sample, judge(sample, now_ns, thresholds), now_ns, thresholds)


def state_of(
    sample: SocketSample, judgement: StallJudgement, now_ns: int, thresholds: StallThresholds
) -> StreamState:
    """The stream state, given the judge's verdict on the same sample."""
    if sample.sender_closed:
        return StreamState.CLOSED
    if judgement.stalled:
        return StreamState.STALLED
    if sample.zero_window:
        return StreamState.ZERO_WINDOW
    recent_zero_window = (
        sample.last_zero_window_end_ns != 0
        and now_ns - sample.last_zero_window_end_ns < thresholds.stall_ns
    )
    if sample.sndbuf_full or sample.sndbuf_fill >= thresholds.slow_fill or recent_zero_window:
        return StreamState.SLOW
    return StreamState.HEALTHY
