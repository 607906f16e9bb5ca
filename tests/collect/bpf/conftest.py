"""Fixtures for tests that load the real BPF programs against real loopback sockets."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwatch.collect.bpf.collector import BpfCollector, SocketEvent
from kvwatch.collect.bpf.layout import KvSockRecord
from kvwatch.collect.bpf.loader import CollectorSettings
from kvwatch.lab.harness.scenario import Scenario
from kvwatch.lab.waiting import wait_for
from kvwatch.sockets import SocketSample

# Two programs on an attach point run one after the other and read the clock separately; under
# software emulation milliseconds can pass between them.
CLOCK_TOLERANCE_NS = 200_000_000
BYTE_FIELDS = {"saddr", "daddr", "comm", "feeder"}


def server_side(
    collector: BpfCollector, client_port: int, when: Callable[[SocketSample], bool] = lambda _: True
) -> SocketSample | None:
    """The server socket whose peer is the client on `client_port`, if tracked and `when`
    holds for it."""
    for sample in collector.samples():
        if sample.remote.port == client_port:
            return sample if when(sample) else None
    return None


def wait_for_server_side(
    collector: BpfCollector,
    client_port: int,
    when: Callable[[SocketSample], bool],
    timeout_seconds: float,
    what: str,
) -> SocketSample:
    found = wait_for(lambda: server_side(collector, client_port, when), timeout_seconds, what)
    assert isinstance(found, SocketSample)
    return found


def in_zero_window(sample: SocketSample) -> bool:
    return sample.zero_window


@pytest.fixture
def scenario() -> Iterator[Scenario]:
    with Scenario() as running:
        yield running


# Both ways of reading kernel memory, on this kernel: BTF-typed programs with plain loads
# (the best mode auto finds; records in socket-local storage, or forced into the LRU hash),
# and kprobe/raw_tp-style bpf_probe_read_kernel (raw tracepoints throughout, as on kernels
# without tp_btf; records in the LRU hash).
READING_FLAVOURS = {
    "btf": {"send_mode": "auto", "tracepoint_mode": "auto"},
    "btf_lru": {"send_mode": "auto", "tracepoint_mode": "auto", "storage": "lru_hash"},
    "probed": {"send_mode": "raw_tp", "tracepoint_mode": "raw_tp"},
}


@pytest.fixture(params=sorted(READING_FLAVOURS))
def open_collector(request: pytest.FixtureRequest) -> Iterator[Callable[..., BpfCollector]]:
    """Builds collectors with the given settings, in each reading flavour, and closes every
    one at teardown."""
    opened: list[BpfCollector] = []
    flavour = READING_FLAVOURS[request.param]

    def build(**settings: object) -> BpfCollector:
        collector = BpfCollector(CollectorSettings(**{**flavour, **settings}))  # type: ignore[arg-type]
        opened.append(collector)
        return collector

    yield build
    for collector in opened:
        collector.close()


class EventLog:
    """Edge events received so far, drained from the ring buffer on demand."""

    def __init__(self, collector: BpfCollector) -> None:
        self.events: list[SocketEvent] = []
        self.ring = collector.open_events(self.events.append)

    def drain(self) -> list[SocketEvent]:
        self.ring.poll(0)
        return self.events

    def kinds_for(self, client_port: int) -> list[str]:
        return [e.kind for e in self.drain() if e.sample.remote.port == client_port]


def records_by_key(records: bytes) -> dict[int, bytes]:
    """A read of the whole table (records back to back), each record by its socket's key."""
    size = ctypes.sizeof(KvSockRecord)
    split = [records[offset : offset + size] for offset in range(0, len(records), size)]
    return {KvSockRecord.from_buffer_copy(raw).sk: raw for raw in split}


def record_fields(record: KvSockRecord) -> dict[str, Any]:
    names = [field[0] for field in KvSockRecord._fields_]
    return {
        name: bytes(getattr(record, name)) if name in BYTE_FIELDS else getattr(record, name)
        for name in names
    }


EPISODE_COUNTERS = ("zero_window_episodes", "sndbuf_full_episodes")


def differences(first: dict[str, Any], second: dict[str, Any], episode_slack: int = 0) -> list[str]:
    """Each field where two views of a record disagree; clocks (`*_ns`) may differ by the
    tolerance, episode counts by `episode_slack`."""
    found = []
    for name, ours in first.items():
        theirs = second[name]
        if name.endswith("_ns"):
            same = (ours == 0) == (theirs == 0) and abs(ours - theirs) <= CLOCK_TOLERANCE_NS
        elif name in EPISODE_COUNTERS:
            same = abs(ours - theirs) <= episode_slack
        else:
            same = ours == theirs
        if not same:
            found.append(f"{name}: {ours!r} vs {theirs!r}")
    return found
