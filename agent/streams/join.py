"""The join: one socket, the engine request behind it, its process and pod, its GPU memory,
built into a `StreamView` (kvwatch.streams.view)."""

from __future__ import annotations

import time

from kvwatch.collect.gpu import GpuInventory, GpuProcessUse
from kvwatch.collect.procfs import ProcessInfo, Procfs
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import SocketSample
from kvwatch.streams.relay import RelayLink
from kvwatch.streams.states import StallJudgement, StallThresholds, judge, state_of
from kvwatch.streams.view import StreamView

PROCESS_CACHE_SECONDS = 10.0
GPU_CACHE_SECONDS = 5.0


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
        thresholds: StallThresholds,
        judgement: StallJudgement | None = None,
        relay: RelayLink | None = None,
    ) -> StreamView:
        """The stream of `sample`; `judgement` is the judge's verdict on it when the caller
        already has one (the stall timers), else it is judged here; `relay` the link through
        which `engine` was found, for a proxy's client socket."""
        pid = engine.engine_pid if engine is not None else sample.pid
        verdict = judgement if judgement is not None else judge(sample, now_ns, thresholds)
        return StreamView(
            sample=sample,
            judgement=verdict,
            state=state_of(sample, verdict, now_ns, thresholds),
            thresholds=thresholds,
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
