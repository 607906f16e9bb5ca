"""Linux's zero-window probe schedule, the clock a stalled socket keeps in the kernel.

When a peer's window closes with data queued, the sender arms the persist timer for
`base` = max(rto, TCP_RTO_MIN); each probe doubles the next interval (icsk_backoff + 1), the
interval is capped at TCP_RTO_MAX, and the peer's answer re-arms the timer for that interval
(tcp_ack_probe), so probe k is answered about

    zero_window_start + sum(min(base * 2**i, 120 s) + rtt for i < k)

The answer carries the peer's current window: the first one after a live reader has freed
its buffer opens the window, so the sender learns of a reopening that was lost in the network
no later than the first probe after it. Read in reverse, the schedule tells how long a socket
that sock_diag shows in persist state has at least been there (`persist_elapsed_ns`).
"""

from __future__ import annotations

NS_PER_SECOND = 1_000_000_000
TCP_RTO_MIN_NS = 200_000_000
TCP_RTO_MAX_NS = 120 * NS_PER_SECOND
# The kernel's timer wheel fires a long timer up to an eighth of its interval late.
TIMER_SLACK_DIVISOR = 8
# More probes than this never matter: the interval is capped long before.
_MAX_PROBES = 64


def probe_base_ns(rto_us: int) -> int:
    """The first probe interval (tcp_probe0_base): the RTO, at least TCP_RTO_MIN."""
    return max(rto_us * 1000, TCP_RTO_MIN_NS)


def probe_interval_ns(base_ns: int, backoff: int) -> int:
    """The interval after `backoff` probes (tcp_probe0_when)."""
    return min(base_ns << min(backoff, _MAX_PROBES), TCP_RTO_MAX_NS)


def answer_after_ns(
    anchor_ns: int, backoff: int, base_ns: int, rtt_ns: int, after_ns: int
) -> tuple[int, int]:
    """When the answer to the first probe sent after `after_ns` arrives: (earliest, latest)
    CLOCK_MONOTONIC ns — timers fire late by up to the timer wheel's slack, never early.
    `anchor_ns` is when the timer was last armed — the newest answer, or the start of the
    zero window — and `backoff` the kernel's icsk_backoff then: it is not reset while the
    window stays too small for a segment, so the schedule goes on from there, not from the
    start of the newest zero-window episode."""
    earliest_ns = latest_ns = anchor_ns
    for step in range(backoff, backoff + _MAX_PROBES):
        interval = probe_interval_ns(base_ns, step)
        earliest_ns += interval + rtt_ns
        latest_ns += interval + interval // TIMER_SLACK_DIVISOR + rtt_ns
        if latest_ns - rtt_ns >= after_ns:
            break
    return max(earliest_ns, after_ns + rtt_ns), latest_ns


def persist_elapsed_ns(backoff: int, rto_us: int, timer_expires_ms: int) -> int:
    """A lower bound on how long the persist timer has run, from sock_diag's view of it: the
    `backoff` intervals of probes already sent, and the part of the current interval already
    gone (its length minus what is left, `timer_expires_ms`). Round-trip times are left out,
    so the bound errs short. It assumes the episode began at backoff 0, which holds unless the
    zero window opened while RTO backoff was still unreset (no RTT sample since a timeout);
    callers cap it with the time since data was last sent (see docs/collector.md)."""
    base_ns = probe_base_ns(rto_us)
    done = sum(probe_interval_ns(base_ns, i) for i in range(min(backoff, _MAX_PROBES)))
    current = probe_interval_ns(base_ns, backoff) - timer_expires_ms * 1_000_000
    return done + max(0, current)
