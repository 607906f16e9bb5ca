"""The BPF collector: kernel records and edge events turned into `SocketSample`s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvwatch.collect.bpf.layout import EVENT_NAMES, KvEvent, KvSockRecord
from kvwatch.collect.bpf.loader import AttachReport, BpfPrograms, CollectorSettings
from kvwatch.collect.bpf.maps import EventRing, SocketTable, read_stats
from kvwatch.collect.bpf.records import RECORD, SampleCache, sample_from_raw
from kvwatch.sockets import SocketSample, Source


def record_to_sample(record: KvSockRecord, observed_ns: int) -> SocketSample:
    """One record's sample: an edge event's, or a single socket read by key."""
    return sample_from_raw(bytes(record), observed_ns)


@dataclass(frozen=True)
class SocketEvent:
    """An edge seen in the kernel: its name, when, and the socket as of that edge."""

    kind: str
    ts_ns: int
    sample: SocketSample

    @classmethod
    def from_raw(cls, event: KvEvent) -> SocketEvent:
        kind = EVENT_NAMES.get(event.type, f"unknown_{event.type}")
        return cls(kind, event.ts_ns, record_to_sample(event.record, event.ts_ns))


BpfBackend = Literal["core", "bcc"]


class LoadedPrograms(Protocol):
    """kvwatch's programs attached by one toolchain: the CO-RE object (`BpfPrograms`) or
    BCC (`BccPrograms`). Both fill the same maps with the same records and events."""

    report: AttachReport
    table: SocketTable
    events_fd: int
    stats_fd: int

    def program_fds(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def load_programs(settings: CollectorSettings, backend: BpfBackend) -> LoadedPrograms:
    if backend == "bcc":
        from kvwatch.collect.bpf.bcc import (
            BccPrograms,  # imports BCC, and with it LLVM: only on demand
        )

        return BccPrograms(settings)
    return BpfPrograms(settings)


class BpfCollector:
    """Owns the loaded programs; reads their maps on demand. Close it to detach. Which
    toolchain built the programs (`backend`) changes nothing in what it returns."""

    source: Source = "bpf"

    def __init__(self, settings: CollectorSettings, backend: BpfBackend = "core") -> None:
        self.programs = load_programs(settings, backend)
        self.cache = SampleCache()
        self._evicted = 0

    @property
    def report(self) -> AttachReport:
        return self.programs.report

    def samples(self) -> list[SocketSample]:
        """Every tracked socket. A sample is made again only when its record changed in a
        way the judge reads (`SampleCache`: on an idle node almost never, and for a healthy
        stream idle between tokens at most every FLOW_REFRESH_NS), so a sample's
        `observed_ns` is when it was made; with a door on the cache (`MergedCollector`'s),
        as the door admitted it."""
        created_before = read_stats(self.programs.stats_fd)["records_created"]
        records = self.programs.table.read_all()
        self._note_table(created_before, len(records) // RECORD.size)
        return self.cache.update(records, time.monotonic_ns())

    def sample(self, key: int) -> SocketSample | None:
        record = self.programs.table.read(key)
        return record_to_sample(record, time.monotonic_ns()) if record is not None else None

    def stats(self, tracked: int | None = None) -> dict[str, int]:
        """Kernel-side counters. `tracked` is the table's size (the caller's count of what
        it just read, else read here); `evictions` the records the LRU map dropped to make
        room, as of the newest read of the whole table (socket-local storage never evicts:
        a record lives as long as its socket, so it is always 0 there)."""
        if tracked is None:
            created_before = read_stats(self.programs.stats_fd)["records_created"]
            tracked = len(self.programs.table.read_all()) // RECORD.size
            self._note_table(created_before, tracked)
        totals = read_stats(self.programs.stats_fd)
        totals["tracked"] = tracked
        totals["evictions"] = self._evicted
        return totals

    def _note_table(self, created_before: int, live: int) -> None:
        """Counts evictions after a read of the whole table that held `live` records: a
        lower bound that never runs ahead of them — records created before the read, less
        those deleted by its end (a socket that opened or closed during the read makes the
        count smaller, never larger: the map is read bucket by bucket, so a record that
        stays is read once), less what it held; never going down."""
        if self.report.storage != "lru_hash":
            return
        deleted_after = read_stats(self.programs.stats_fd)["records_deleted"]
        self._evicted = max(self._evicted, created_before - deleted_after - live)

    def open_events(self, handler: Callable[[SocketEvent], None]) -> EventRing:
        return EventRing(self.programs.events_fd, lambda raw: handler(SocketEvent.from_raw(raw)))

    def close(self) -> None:
        self.programs.close()
