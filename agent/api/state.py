"""`AgentState`: the agent as its readers see it, read-only. The HTTP API and the Prometheus
exporters read the agent through this interface and nothing else, so neither imports the
daemon that satisfies it, and no arrow runs from them back up to it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvwatch.act.tally import ActionTally
from kvwatch.collect.bpf.collector import BpfCollector
from kvwatch.collect.collectors import OpenedCollector, TableStatus
from kvwatch.collect.gpu import GpuInventory
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import SocketSample
from kvwatch.streams.states import StallThresholds
from kvwatch.streams.timeline import Timeline
from kvwatch.streams.view import StreamView


class HookStatus(Protocol):
    """The engine-hook server, as far as its readers go: who is connected, what they sent."""

    def engines(self) -> list[dict[str, object]]: ...

    def connection_count(self) -> int: ...

    def counters(self) -> dict[str, int]: ...

    def streams(self) -> list[EngineStream]: ...


class TimelineIndex(Protocol):
    """The per-stream timelines `kvwatch explain` reads, live and finished."""

    @property
    def history_size(self) -> int: ...

    def find(self, request_id: str) -> Timeline | None: ...

    def find_endpoint(self, endpoint: str) -> Timeline | None: ...

    def live_count(self) -> int: ...

    def finished_count(self) -> int: ...


class AgentState(Protocol):
    """Everything a reader may ask of the agent. Implementations answer from state they
    already hold (a scrape or a request never waits on the kernel or an engine), on the
    agent's event loop."""

    @property
    def mode(self) -> str:
        """The policy mode: "observe" or "enforce"."""

    @property
    def stall_thresholds(self) -> StallThresholds: ...

    @property
    def started_ns(self) -> int: ...

    @property
    def opened(self) -> OpenedCollector | None:
        """The socket collector in use and why, once started."""

    @property
    def bpf(self) -> BpfCollector | None: ...

    @property
    def table(self) -> TableStatus | None: ...

    @property
    def gpus(self) -> GpuInventory: ...

    @property
    def hooks(self) -> HookStatus: ...

    @property
    def timelines(self) -> TimelineIndex: ...

    @property
    def decisions(self) -> Mapping[tuple[str, str], int]:
        """Policy decisions so far, by (verdict, reason)."""

    @property
    def tally(self) -> ActionTally: ...

    @property
    def unread_tokens_at_end(self) -> int:
        """Tokens engines wrote that their readers had not read when their streams ended
        (kvwatch.streams.backlog.FlowMeter.unread_tokens: an estimate)."""

    @property
    def scan_samples(self) -> Mapping[str, int]:
        """Samples the agent's full scans took so far: "judged" (new since the scan before:
        passed to the episode runner) and "kept" (the collector kept them unchanged in every
        way the judge reads: judged at no cost)."""

    def samples(self) -> list[SocketSample]: ...

    def stream_views(self) -> list[StreamView]: ...

    def events_after(self, since: int) -> list[dict[str, Any]]:
        """The decision and action events with an id above `since`, oldest first."""
