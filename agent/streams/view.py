"""What a stream looks like: `StreamView`, everything known about one stream (the unit of
policy, API and metrics), and its JSON — the `sockets --json` and `streams --json` contracts
(docs/contracts.md), which the API, the audit log and `kvwatch top` all build on. Plain data;
people's tables are in tools/tables.py; the join that builds a view is streams/join.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwatch.collect.gpu import GpuProcessUse
from kvwatch.collect.procfs import ProcessInfo
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import SocketSample
from kvwatch.streams.backlog import Backlog, backlog_of
from kvwatch.streams.relay import RelayLink
from kvwatch.streams.states import StallJudgement, StallThresholds, StreamState, judge, state_of


def socket_json(
    sample: SocketSample,
    now_ns: int,
    thresholds: StallThresholds,
    judgement: StallJudgement | None = None,
    backlog: Backlog | None = None,
    *,
    feeder: bool = True,
) -> dict[str, Any]:
    """One socket as the `kvwatch sockets --json` contract spells it (plus a few extras).
    `stalled_seconds` is how long every stall condition has held, `stall_required_seconds`
    how long they must hold before the socket is `stalled` (null when they do not hold), and
    `stall_evidence` what the judge based that on (docs/collector.md); `backlog` what its
    reader has not read (kvwatch.streams.backlog: in seconds only where the agent measured
    the stream's rate); `feeder` the socket it relays, unless `feeder` is False (the agent's
    relay join found the kernel's pairing to be no relay: a server reading one client and
    writing another)."""
    verdict = judgement if judgement is not None else judge(sample, now_ns, thresholds)
    unread = backlog if backlog is not None else backlog_of(sample)
    return {
        "local": str(sample.local),
        "remote": str(sample.remote),
        "pid": sample.pid,
        "comm": sample.comm,
        "orphaned": sample.orphaned,
        "state": state_of(sample, verdict, now_ns, thresholds).value,
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
        "stall_evidence": verdict.evidence(thresholds),
        "source": sample.source,
        "snd_cwnd": sample.snd_cwnd,
        "zero_window_probes": sample.zero_window_probes,
        "zero_window_total_seconds": round(sample.zero_window_total_ns / 1e9, 3),
        "sndbuf_full_episodes": sample.sndbuf_full_episodes,
        "peer_rwnd_max": sample.peer_rwnd_max,
        "netns": sample.netns,
        "inode": sample.inode,
        "feeder": feeder_json(sample, now_ns) if feeder else None,
        "backlog": unread.to_json(),
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


@dataclass(frozen=True)
class StreamView:
    """Everything known about one stream at `now_ns`; the unit of policy, API and metrics.

    `engine` is the request the socket carries: announced on the socket itself, or, for a
    proxy's client socket, on the upstream that `relay` links it to. `relay` is None for a
    socket no relay writes or reads: for the engine's own socket behind a proxy it is the
    `relayed` link to the proxy's client socket that decides for it. `process` is the
    engine's (else the socket owner's), and `relay_process` the relaying process's.
    `action_failed` names the actions of this stall episode that failed after their last
    try (kvwatch.act.carry), None when none did; `backlog` what its reader has not read, at
    the stream's measured rate (None: judged from the sample alone)."""

    sample: SocketSample
    judgement: StallJudgement
    state: StreamState
    thresholds: StallThresholds
    engine: EngineStream | None
    process: ProcessInfo | None
    gpus: tuple[GpuProcessUse, ...]
    now_ns: int
    relay: RelayLink | None = None
    relay_process: ProcessInfo | None = None
    action_failed: dict[str, Any] | None = None
    backlog: Backlog | None = None

    @property
    def opened_ns(self) -> int:
        """When the stream began: the engine's announcement, else the socket's first sight."""
        return self.engine.opened_ns if self.engine is not None else self.sample.first_seen_ns

    @property
    def kv_bytes(self) -> int | None:
        return self.engine.kv_bytes if self.engine is not None else None

    @property
    def owner_pid(self) -> int:
        """Who owns the stream: the engine that announced it, else the collector's finding."""
        return self.engine.engine_pid if self.engine is not None else self.sample.pid

    @property
    def socket_pid(self) -> int:
        """Who owns the socket itself: the collector's finding for a socket with a relay link
        (the relay, for a proxy's client socket), else the engine that announced it."""
        return self.sample.pid if self.relay is not None else self.owner_pid

    @property
    def chain(self) -> str | None:
        """`client ⇄ nginx[812] ⇄ engine request cmpl-1` for a relayed socket, else None."""
        if self.relay is None:
            return None
        return self.relay.chain(self.engine.request_id if self.engine else None)

    def socket_row(self) -> dict[str, Any]:
        """The socket as `kvwatch sockets --json` spells it, with what the join knows: the
        backlog at the stream's rate, and the feeder only where it makes a relay link."""
        return socket_json(
            self.sample,
            self.now_ns,
            self.thresholds,
            self.judgement,
            self.backlog,
            feeder=self.relay is not None,
        )

    def to_json(self) -> dict[str, Any]:
        """The `kvwatch streams --json` contract: the socket plus the join."""
        row = self.socket_row()
        engine = self.engine
        row.update(
            request_id=engine.request_id if engine else None,
            engine=engine.engine if engine else None,
            engine_pid=engine.engine_pid if engine else None,
            kv_blocks=engine.kv_blocks if engine else None,
            kv_bytes=self.kv_bytes,
            kv_estimated=engine.kv_estimated if engine else None,
            parked=engine.parked if engine else None,
            paused=engine.paused if engine else None,
            parked_kv_bytes=engine.parked_blocks * engine.bytes_per_block if engine else None,
            detached=engine.detached if engine else None,
            gpu=[
                {"index": g.gpu_index, "uuid": g.uuid, "used_bytes": g.used_bytes}
                for g in self.gpus
            ]
            or None,
            cgroup=self.process.cgroup_path if self.process else None,
            container_id=(self.process.container_id or None) if self.process else None,
            pod_uid=(self.process.pod_uid or None) if self.process else None,
            age_seconds=round((self.now_ns - self.opened_ns) / 1e9, 3),
            relay=(
                {**self.relay.to_json(), "chain": self.chain} if self.relay is not None else None
            ),
            action_failed=self.action_failed,
        )
        return row
