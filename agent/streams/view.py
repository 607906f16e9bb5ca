"""How a socket reads in JSON: the `sockets --json` contract (docs/contracts.md), which the API, the
stream view and `kvwatch top` all build on. Plain data; people's tables are in tools/tables.py."""

from __future__ import annotations

from typing import Any

from kvwatch.sockets import SocketSample
from kvwatch.streams.states import StallJudgement, StatePolicy, judge, state_of


def socket_json(
    sample: SocketSample,
    now_ns: int,
    policy: StatePolicy,
    judgement: StallJudgement | None = None,
) -> dict[str, Any]:
    """One socket as the `kvwatch sockets --json` contract spells it (plus a few extras).
    `stalled_seconds` is how long every stall condition has held, `stall_required_seconds`
    how long they must hold before the socket is `stalled` (null when they do not hold), and
    `stall_evidence` what the judge based that on (docs/collector.md)."""
    verdict = judgement if judgement is not None else judge(sample, now_ns, policy)
    return {
        "local": str(sample.local),
        "remote": str(sample.remote),
        "pid": sample.pid,
        "comm": sample.comm,
        "orphaned": sample.sender_closed and sample.pid == 0,
        "state": state_of(sample, verdict, now_ns, policy).value,
        "wmem_queued": sample.wmem_queued,
        "sndbuf": sample.sndbuf,
        "notsent_bytes": sample.notsent_bytes,
        "unacked_bytes": sample.unacked_bytes,
        "peer_rwnd": sample.peer_rwnd,
        "srtt_us": sample.srtt_us,
        "retransmits": sample.retransmits,
        "zero_window": sample.zero_window,
        "zero_window_episodes": sample.zero_window_episodes,
        "zero_window_seconds": round(sample.zero_window_seconds(now_ns), 3),
        "sndbuf_full": sample.sndbuf_full,
        "no_progress_seconds": round(sample.no_progress_seconds(now_ns), 3),
        "stalled_seconds": round(verdict.stalled_seconds(now_ns), 3),
        "stall_required_seconds": (
            round(verdict.required_ns / 1e9, 3) if verdict.on_the_way else None
        ),
        "stall_evidence": verdict.evidence(policy),
        "source": sample.source,
        "snd_cwnd": sample.snd_cwnd,
        "zero_window_probes": sample.zero_window_probes,
        "zero_window_total_seconds": round(sample.zero_window_total_ns / 1e9, 3),
        "sndbuf_full_episodes": sample.sndbuf_full_episodes,
        "peer_rwnd_max": sample.peer_rwnd_max,
        "netns": sample.netns,
        "inode": sample.inode,
        "feeder": feeder_json(sample, now_ns),
    }


def feeder_json(sample: SocketSample, now_ns: int) -> dict[str, Any] | None:
    """The socket whose data this one relays (a proxy's upstream), or None."""
    feeder = sample.feeder
    if feeder is None:
        return None
    return {
        "local": str(feeder.local),
        "remote": str(feeder.remote),
        "feeds": feeder.feeds,
        "misses": feeder.misses,
        "fed_seconds_ago": round(sample.seconds_since(feeder.fed_ns, now_ns), 3),
    }
