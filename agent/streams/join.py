"""The join: one socket, the engine request behind it, its process and pod, its GPU memory."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvwatch.collect.gpu import GpuInventory, GpuProcessUse
from kvwatch.collect.procfs import ProcessInfo, Procfs
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import SocketSample
from kvwatch.streams.relay import RelayLink
from kvwatch.streams.states import StallJudgement, StatePolicy, StreamState, judge, state_of
from kvwatch.streams.view import socket_json

PROCESS_CACHE_SECONDS = 10.0
GPU_CACHE_SECONDS = 5.0


@dataclass(frozen=True)
class StreamView:
    """Everything known about one stream at `now_ns`; the unit of policy, API and metrics.

    `engine` is the request the socket carries: announced on the socket itself, or, for a
    proxy's client socket, on the upstream that `relay` links it to. `relay` is None for a
    socket no relay writes or reads: for the engine's own socket behind a proxy it is the
    `relayed` link to the proxy's client socket that decides for it. `process` is the
    engine's (else the socket owner's), and `relay_process` the relaying process's.
    `action_failed` names the actions of this stall episode that failed after their last
    try (kvwatch.policy.decide), None when none did."""

    sample: SocketSample
    judgement: StallJudgement
    state: StreamState
    policy: StatePolicy
    engine: EngineStream | None
    process: ProcessInfo | None
    gpus: tuple[GpuProcessUse, ...]
    now_ns: int
    relay: RelayLink | None = None
    relay_process: ProcessInfo | None = None
    action_failed: dict[str, Any] | None = None

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

    def to_json(self) -> dict[str, Any]:
        """The `kvwatch streams --json` contract: the socket plus the join."""
        row = socket_json(self.sample, self.now_ns, self.policy, self.judgement)
        engine = self.engine
        row.update(
            request_id=engine.request_id if engine else None,
            engine=engine.engine if engine else None,
            engine_pid=engine.engine_pid if engine else None,
            kv_blocks=engine.kv_blocks if engine else None,
            kv_bytes=self.kv_bytes,
            kv_estimated=engine.kv_estimated if engine else None,
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


class Joiner:
    """Builds StreamViews. Caches process identity (per pid) and GPU use (per snapshot) so a
    view costs dictionary lookups; owned by the daemon's event loop."""

    def __init__(self, procfs: Procfs, gpus: GpuInventory) -> None:
        self.procfs = procfs
        self.gpus = gpus
        self._processes: dict[int, tuple[float, ProcessInfo | None]] = {}
        self._gpu_taken = 0.0

    def process(self, pid: int) -> ProcessInfo | None:
        if pid <= 0:
            return None
        now = time.monotonic()
        cached = self._processes.get(pid)
        if cached is None or now - cached[0] > PROCESS_CACHE_SECONDS:
            cached = (now, self.procfs.process(pid))
            self._processes[pid] = cached
        return cached[1]

    def gpu_use(self, pid: int) -> tuple[GpuProcessUse, ...]:
        if not self.gpus.available or pid <= 0:
            return ()
        now = time.monotonic()
        if now - self._gpu_taken > GPU_CACHE_SECONDS:
            self.gpus.snapshot()
            self._gpu_taken = now
        return tuple(self.gpus.process_gpu(pid))

    def view(
        self,
        sample: SocketSample,
        engine: EngineStream | None,
        now_ns: int,
        policy: StatePolicy,
        judgement: StallJudgement | None = None,
        relay: RelayLink | None = None,
    ) -> StreamView:
        """The stream of `sample`; `judgement` is the judge's verdict on it when the caller
        already has one (the stall timers), else it is judged here; `relay` the link through
        which `engine` was found, for a proxy's client socket."""
        pid = engine.engine_pid if engine is not None else sample.pid
        verdict = judgement if judgement is not None else judge(sample, now_ns, policy)
        return StreamView(
            sample=sample,
            judgement=verdict,
            state=state_of(sample, verdict, now_ns, policy),
            policy=policy,
            engine=engine,
            process=self.process(pid),
            gpus=self.gpu_use(pid),
            now_ns=now_ns,
            relay=relay,
            relay_process=self.process(relay.relay_pid) if relay is not None else None,
        )

    def forget_processes(self) -> None:
        """Drops cached identities (pids are reused); the daemon calls it now and then."""
        self._processes.clear()
