"""`Daemon`: one asyncio process that runs the whole pipeline (docs/architecture.md) —
collector, engine hook server, join, stall timers, policy, actions, audit log, exporters and
the HTTP API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from kvwatch.act.actions import Actions
from kvwatch.act.audit import AuditLog
from kvwatch.act.carry import Executor
from kvwatch.act.episode_runner import EpisodeRunner
from kvwatch.act.record import Recorder
from kvwatch.act.tally import ActionTally
from kvwatch.collect.bpf.collector import BpfCollector, SocketEvent
from kvwatch.collect.bpf.maps import EventRing
from kvwatch.collect.collectors import (
    MergedCollector,
    OpenedCollector,
    TableStatus,
    connection_key,
    needed_sockets,
    open_collector,
)
from kvwatch.collect.gpu import GpuInventory, NvmlApi
from kvwatch.collect.listeners import ListeningPorts
from kvwatch.collect.procfs import Procfs
from kvwatch.config.schema import AgentConfig
from kvwatch.exporters import agent_registry
from kvwatch.exporters.durations import EpisodeDurations
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.policy.decide import Decider
from kvwatch.sockets import SocketSample
from kvwatch.streams.join import Joiner
from kvwatch.streams.relay import FeedLedger, RelayIndex, RelayLink
from kvwatch.streams.states import StallJudgement, StallThresholds
from kvwatch.streams.timeline import Timelines, connection_id
from kvwatch.streams.view import StreamView

log = logging.getLogger(__name__)

BPF_SCAN_SECONDS = 1.0
DIAG_SCAN_SECONDS = 0.5
TABLE_WARNING_NS = 300 * 1_000_000_000


class Daemon:
    """Owns every part of the agent; all of them run on one event loop, except the collector
    (its own thread: netlink and map reads block) and resets (their own thread: setns).
    Invariant: a socket is followed by the episode runner from its first edge event or scan
    under pressure until it closes or nothing about it can change any more."""

    def __init__(self, config: AgentConfig, nvml: NvmlApi | None = None) -> None:
        self.config = config
        self.stall_thresholds = StallThresholds.of_policy(config.policy)
        self.procfs = Procfs(config.path.procfs)
        self.gpus = GpuInventory(nvml)
        self.joiner = Joiner(self.procfs, self.gpus)
        self.hooks = HookServer(
            config.hook.socket, config.hook.allowed_uids, on_change=self._on_stream_change
        )
        lease_ms = int(config.policy.lease_seconds * 1000)
        self.actions = Actions(self.hooks, config.path.procfs, lease_ms)
        self.timelines = Timelines(config.streams.history_size)
        self.recorder = Recorder(AuditLog(config.audit.path or None), self.timelines)
        # What relay joins keep between looks: each client socket's feed counts (noted from
        # every sample the daemon takes in) and the listening ports of each namespace.
        self.feed_ledger = FeedLedger()
        self.listeners = ListeningPorts(config.path.procfs)
        self.executor = Executor(self.actions, self.recorder, Decider(config.policy), self.joiner)
        self.durations = EpisodeDurations()
        self.runner = EpisodeRunner(
            config.policy,
            self.executor,
            self.recorder,
            self.timelines,
            self._read_sample,
            self._view_of,
            self._carries_stream,
            self.durations.stall_ended,
        )
        self.registry = agent_registry(self, self.durations)
        self.opened: OpenedCollector | None = None
        self.started_ns = time.monotonic_ns()
        self._collect = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvwatch-collect"
        )
        self._ring: EventRing | None = None
        self._samples: dict[int, SocketSample] = {}
        self._samples_ns = 0
        # Tokens engines wrote that their readers had not read when their streams ended.
        self.unread_tokens_at_end = 0
        self.scan_samples = {"judged": 0, "kept": 0}
        self._live: dict[str, EngineStream] = {}
        self._table_warned_ns = 0
        self._stop = asyncio.Event()

    # -- start and stop ----------------------------------------------------------------

    async def start(self) -> None:
        """Attaches the collector and opens the hook socket; the agent is ready after it."""
        loop = asyncio.get_running_loop()
        settings = self.config.collector.settings()
        self.opened = await loop.run_in_executor(
            self._collect,
            open_collector,
            settings,
            self.config.collector.backend,
            self.config.path.procfs,
        )
        log.info("%s", self.opened.note)
        bpf = self.bpf
        if bpf is not None:
            self._ring = bpf.open_events(self._admit_event)
            loop.add_reader(self._ring.fileno(), self._ring.consume)
        await self.hooks.start()
        await self.scan()

    async def run(self) -> None:
        """Scans until `stop()`; edge events and timers drive decisions in between."""
        interval = BPF_SCAN_SECONDS if self.bpf is not None else DIAG_SCAN_SECONDS
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), interval)
            except TimeoutError:
                await self.scan()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        self.runner.close()
        if self._ring is not None:
            asyncio.get_running_loop().remove_reader(self._ring.fileno())
            self._ring.close()
        await self.hooks.close()
        self.actions.close()
        if self.opened is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._collect, self.opened.collector.close
            )
        self._collect.shutdown(wait=True)
        self.gpus.close()
        self.recorder.close()

    # -- what the collector sees ---------------------------------------------------------

    @property
    def bpf(self) -> BpfCollector | None:
        collector = self.opened.collector if self.opened is not None else None
        if isinstance(collector, MergedCollector):
            return collector.bpf
        return collector if isinstance(collector, BpfCollector) else None

    async def scan(self) -> None:
        """A full read of the collector: refreshes the socket table and arms stall timers
        for sockets under back-pressure that no edge event announced (restart, diag mode).
        Only samples new since the last scan go to the runner: a healthy stream whose
        sample the collector kept costs a lookup here, not a judgement."""
        assert self.opened is not None
        loop = asyncio.get_running_loop()
        samples = await loop.run_in_executor(self._collect, self.opened.collector.samples)
        previous, self._samples = self._samples, {sample.key: sample for sample in samples}
        # A sample the collector kept from the last scan (the very object: its record moved
        # in no way the judge reads, see SampleCache) told the ledger and the runner all it
        # can (docs/collector.md, "What a scan judges").
        news = [sample for sample in samples if previous.get(sample.key) is not sample]
        self.scan_samples["judged"] += len(news)
        self.scan_samples["kept"] += len(samples) - len(news)
        self.feed_ledger.note_all(self._samples.keys(), news)
        self._samples_ns = now_ns = time.monotonic_ns()
        if self.bpf is None:  # sock_diag polling has no close events: a vanished socket closed
            for key in previous.keys() - self._samples.keys():
                self._gone(previous[key], now_ns)
        if self.timelines.sweep_due(now_ns):
            self.timelines.sweep({connection_id(s.local, s.remote) for s in samples}, now_ns)
        for sample in news:
            self.runner.observe(sample, now_ns)
        # A set of every socket only where an open episode is to be matched against it.
        if len(self.runner.episodes):
            self.runner.left({connection_key(s) for s in samples}, now_ns)
        self._warn_if_table_full()

    @property
    def table(self) -> TableStatus | None:
        """The kernel socket table's fill (None without BPF)."""
        collector = self.opened.collector if self.opened is not None else None
        return collector.table if isinstance(collector, MergedCollector) else None

    def _warn_if_table_full(self) -> None:
        """A full table is loud: a warning when it starts evicting, then every few minutes."""
        table = self.table
        if table is None or not table.full:
            self._table_warned_ns = 0
            return
        now_ns = time.monotonic_ns()
        if self._table_warned_ns and now_ns - self._table_warned_ns < TABLE_WARNING_NS:
            return
        self._table_warned_ns = now_ns
        log.warning(
            "the kernel socket table is full: %d records, %d evicted; sock_diag sweeps for "
            "stalls it has no room for (%s sockets watched). Raise --max-sockets "
            "(collector.max_sockets) to at least %s",
            table.max_sockets,
            table.evictions,
            table.sockets_seen,
            needed_sockets(table),
        )

    async def _read_sample(self, key: int) -> SocketSample | None:
        """A fresh look at one socket through the collector's door (owner, carry-over); the
        last scan's view when the collector has none fresher (sock_diag, bootstrap)."""
        assert self.opened is not None
        loop = asyncio.get_running_loop()
        fresh = await loop.run_in_executor(self._collect, self.opened.collector.sample, key)
        if fresh is None:
            return self._samples.get(key)
        self.feed_ledger.note(fresh)
        return fresh

    def samples(self) -> list[SocketSample]:
        return list(self._samples.values())

    # -- what readers see (kvwatch.api.state.AgentState) -----------------------------------

    @property
    def mode(self) -> str:
        return self.config.policy.mode

    @property
    def decisions(self) -> Mapping[tuple[str, str], int]:
        return self.recorder.decisions

    @property
    def tally(self) -> ActionTally:
        return self.actions.tally

    def events_after(self, since: int) -> list[dict[str, Any]]:
        return self.recorder.events_after(since)

    def behind(
        self, sample: SocketSample, index: RelayIndex | None = None
    ) -> tuple[EngineStream | None, RelayLink | None]:
        """The engine request a socket carries (announced on it, or on the upstream of the
        proxy that writes it) and the relay link it came through; `index` is the relays of
        the current socket table, built here when the caller has none."""
        relays = index if index is not None else self._relays()
        return relays.behind(sample, self.hooks)

    def _relays(self) -> RelayIndex:
        return RelayIndex(
            self._samples.values(),
            listeners=self.listeners,
            ledger=self.feed_ledger,
            cancels=self.actions.cancels,
        )

    def stream_views(self) -> list[StreamView]:
        now_ns = time.monotonic_ns()
        index = self._relays()
        views = []
        for sample in self._samples.values():
            engine, relay = self.behind(sample, index)
            view = self.joiner.view(sample, engine, now_ns, self.stall_thresholds, relay=relay)
            views.append(
                dataclasses.replace(
                    view,
                    action_failed=self.runner.failed(sample),
                    backlog=self.runner.backlog(sample),
                )
            )
        return views

    def _view_of(self, sample: SocketSample, now_ns: int, judgement: StallJudgement) -> StreamView:
        """One socket joined into its stream, for a look (kvwatch.act.episode_runner)."""
        engine, relay = self.behind(sample)
        return self.joiner.view(sample, engine, now_ns, self.stall_thresholds, judgement, relay)

    def _carries_stream(self, sample: SocketSample) -> bool:
        """Whether the socket may carry an engine's stream: an engine announced a request on
        it, or a proxy relays into it (its feeder)."""
        return sample.feeder is not None or self.hooks.find(sample.local, sample.remote) is not None

    # -- edges, stalls and engine streams ------------------------------------------------

    def _admit_event(self, event: SocketEvent) -> None:
        """Edge events pass the collector's door on its thread, like every other sample; one
        worker thread completes them in arrival order."""
        assert self.opened is not None
        admitted = self._collect.submit(self.opened.collector.admit, event.sample)
        asyncio.wrap_future(admitted).add_done_callback(
            lambda done: self._on_event(SocketEvent(event.kind, event.ts_ns, done.result()))
        )

    def _on_event(self, event: SocketEvent) -> None:
        sample, key = event.sample, event.sample.key
        self.timelines.note_socket(sample, event.ts_ns, event.kind)
        if event.kind in ("zero_window_start", "zero_window_end"):
            started = event.kind == "zero_window_start"
            ended = self.runner.zero_window(key, started, event.ts_ns)
            if ended is not None:
                self.durations.zero_window_ended(ended)
        if event.kind == "close":
            self._gone(sample, event.ts_ns)
            self.timelines.close(
                connection_id(sample.local, sample.remote),
                event.ts_ns,
                self._last_view_json(sample),
            )
            return
        self._samples[key] = sample
        self.feed_ledger.note(sample)
        self.runner.observe(sample, time.monotonic_ns())

    def _last_view_json(self, sample: SocketSample) -> dict[str, object] | None:
        """The stream as it was when its socket closed, if an engine announced it."""
        engine = next(
            (
                s
                for s in self._live.values()
                if s.local == sample.local and s.remote == sample.remote
            ),
            None,
        )
        if engine is None:
            return None
        view = self.joiner.view(sample, engine, time.monotonic_ns(), self.stall_thresholds)
        return view.to_json()

    def _gone(self, sample: SocketSample, now_ns: int) -> None:
        """The socket closed: the one place where all that is kept about it ends."""
        self._samples.pop(sample.key, None)
        self.feed_ledger.forget(sample.key)
        self.runner.gone(sample, now_ns)

    def _on_stream_change(self, request_id: str, stream: EngineStream | None) -> None:
        if stream is not None:
            before = self._live.get(request_id)
            if before is not None and before.parked and not stream.parked:
                self._resumed(stream)
            self._live[request_id] = stream
            self.timelines.bind(
                connection_id(stream.local, stream.remote), request_id, stream.opened_ns
            )
            return
        ended = self._live.pop(request_id, None)
        if ended is None:
            return
        unread = self.runner.meter.unread_tokens(ended.local, ended.remote, ended.tokens_out)
        self.unread_tokens_at_end += unread or 0
        timeline = self.timelines.find(request_id)
        if timeline is not None and not timeline.closed:
            timeline.add(time.monotonic_ns(), "engine_closed_stream", unread_tokens=unread)

    def _resumed(self, stream: EngineStream) -> None:
        """A parked request runs again: counted, and on its timeline."""
        self.actions.tally.resumes += 1
        self.timelines.of(connection_id(stream.local, stream.remote)).add(
            time.monotonic_ns(), "resumed", kv_blocks=stream.kv_blocks
        )
