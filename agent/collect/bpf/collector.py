"""The BPF collector: kernel records and edge events turned into `SocketSample`s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvwatch.collect.bpf.layout import EVENT_NAMES, KvEvent, KvSockRecord
from kvwatch.collect.bpf.loader import AttachReport, BpfPrograms, CollectorSettings
from kvwatch.collect.bpf.maps import EventRing, SocketTable, read_stats
from kvwatch.sockets import TCP_CLOSE, Endpoint, Feeder, SocketSample, Source

SEQ_MODULO = 1 << 32
TCP_STATE_OFFSET = KvSockRecord.tcp_state.offset


def seq_distance(later: int, earlier: int) -> int:
    """Bytes from `earlier` to `later` in 32-bit sequence space (0 if `later` is behind)."""
    distance = (later - earlier) % SEQ_MODULO
    return distance if distance < SEQ_MODULO // 2 else 0


def _feeder(record: KvSockRecord) -> Feeder | None:
    if not record.feeder_sk:
        return None
    ends = record.feeder
    return Feeder(
        local=Endpoint.from_packed(ends.family, bytes(ends.saddr), ends.sport),
        remote=Endpoint.from_packed(ends.family, bytes(ends.daddr), ends.dport),
        feeds=record.feeds,
        misses=record.feeder_misses,
        fed_ns=record.fed_ns,
    )


def record_to_sample(record: KvSockRecord, observed_ns: int) -> SocketSample:
    return SocketSample(
        key=record.sk,
        source="bpf",
        observed_ns=observed_ns,
        local=Endpoint.from_packed(record.family, bytes(record.saddr), record.sport),
        remote=Endpoint.from_packed(record.family, bytes(record.daddr), record.dport),
        netns=record.netns,
        inode=record.inode,
        pid=record.tgid,
        comm=record.comm.decode(errors="replace"),
        tcp_state=record.tcp_state,
        wmem_queued=record.wmem_queued,
        sndbuf=record.sndbuf,
        notsent_bytes=seq_distance(record.write_seq, record.snd_nxt),
        unacked_bytes=seq_distance(record.snd_nxt, record.snd_una),
        peer_rwnd=record.peer_rwnd,
        srtt_us=record.srtt_us,
        snd_cwnd=record.snd_cwnd,
        retransmits=record.retransmits,
        zero_window_probes=record.zero_window_probes,
        zero_window_episodes=record.zero_window_episodes,
        zero_window_since_ns=record.zero_window_since_ns,
        zero_window_total_ns=record.zero_window_total_ns,
        last_zero_window_end_ns=record.last_zero_window_end_ns,
        sndbuf_full_episodes=record.sndbuf_full_episodes,
        sndbuf_full_since_ns=record.sndbuf_full_since_ns,
        progress_ns=record.progress_ns,
        first_seen_ns=record.first_seen_ns,
        bytes_acked=record.bytes_acked,
        first_send_ns=record.first_send_ns,
        first_acked_ns=record.first_acked_ns,
        peer_rwnd_max=record.peer_rwnd_max,
        rto_us=record.srtt_us + record.rttvar_us,
        probe_backoff=record.probe_backoff,
        last_ack_ns=record.last_ack_ns,
        feeder=_feeder(record),
    )


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
        self._converted: dict[int, tuple[bytes, SocketSample]] = {}
        self._evicted = 0

    @property
    def report(self) -> AttachReport:
        return self.programs.report

    def samples(self) -> list[SocketSample]:
        """Every tracked socket. Only records whose bytes changed since the last call are
        converted again (on an idle node almost none are), so a sample's `observed_ns` is when
        its record was last read changed."""
        created_before = read_stats(self.programs.stats_fd)["records_created"]
        raw_records = self.programs.table.read_raw()
        self._note_table(created_before, len(raw_records))
        now_ns = time.monotonic_ns()
        converted: dict[int, tuple[bytes, SocketSample]] = {}
        for key, raw in raw_records.items():
            if raw[TCP_STATE_OFFSET] == TCP_CLOSE:
                continue  # a socket closing as the map was read; its close event removes it
            previous = self._converted.get(key)
            if previous is not None and previous[0] == raw:
                converted[key] = previous
            else:
                record = KvSockRecord.from_buffer_copy(raw)
                converted[key] = (raw, record_to_sample(record, now_ns))
        self._converted = converted
        return [sample for _, sample in converted.values()]

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
            tracked = len(self.programs.table.read_raw())
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
