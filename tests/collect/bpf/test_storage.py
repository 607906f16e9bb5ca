"""Socket-local storage read through the BPF iterator holds the same records as the LRU hash.

Both layouts are attached at once to the same attach points of this kernel (BTF-typed programs, the
only ones that can use socket-local storage) and watch the same clients: every field of every
record, the `sockets --json` rows and the edge events must agree; only the clocks may differ
by the moment between the two programs' runs.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvwatch.collect.bpf.collector import BpfCollector, record_to_sample
from kvwatch.collect.bpf.layout import KvSockRecord
from kvwatch.collect.bpf.loader import CollectorSettings
from kvwatch.errors import BpfError
from kvwatch.lab.harness.scenario import Scenario
from kvwatch.lab.waiting import wait_for
from kvwatch.streams.states import StallThresholds
from kvwatch.streams.view import socket_json
from tests.collect.bpf.conftest import (
    EventLog,
    differences,
    in_zero_window,
    record_fields,
    records_by_key,
    wait_for_server_side,
)

pytestmark = pytest.mark.bpf
SETTLE_SECONDS = 5.0
SECONDS_TOLERANCE = 0.01
POLICY = StallThresholds()


@dataclass
class Layouts:
    """One collector per record layout, on the same attach points and port. Owned by the fixture."""

    storage: BpfCollector
    hashed: BpfCollector
    scenario: Scenario


@pytest.fixture
def layouts() -> Iterator[Layouts]:
    with Scenario() as scenario:
        settings = CollectorSettings(ports=(scenario.port,), tracepoint_mode="tp_btf")
        try:
            storage = BpfCollector(CollectorSettings(**{**vars(settings), "storage": "sk_storage"}))
        except BpfError as exc:
            pytest.skip(f"no socket-local storage on this kernel: {exc.message}")
        hashed = BpfCollector(
            CollectorSettings(
                **{**vars(settings), "storage": "lru_hash", "send_mode": storage.report.send_mode}
            )
        )
        try:
            yield Layouts(storage, hashed, scenario)
        finally:
            hashed.close()
            storage.close()


def agreeing(layouts: Layouts) -> dict[int, tuple[bytes, bytes]]:
    """Every record in both layouts, read while no program touched them (the storage table is
    read before and after the hash and must not have changed); fails with what disagrees."""
    deadline = time.monotonic() + SETTLE_SECONDS
    last = ["no quiet moment to read both tables in"]
    while time.monotonic() < deadline:
        before = records_by_key(layouts.storage.programs.table.read_all())
        hashed = records_by_key(layouts.hashed.programs.table.read_all())
        after = records_by_key(layouts.storage.programs.table.read_all())
        if before == after:
            if before.keys() != hashed.keys():
                last = [f"keys differ: {sorted(before)} vs {sorted(hashed)}"]
            else:
                last = [
                    f"{key:#x} {line}"
                    for key in before
                    for line in differences(
                        record_fields(KvSockRecord.from_buffer_copy(before[key])),
                        record_fields(KvSockRecord.from_buffer_copy(hashed[key])),
                    )
                ]
                if not last:
                    return {key: (before[key], hashed[key]) for key in before}
        time.sleep(0.02)
    raise AssertionError("the two layouts differ:\n" + "\n".join(last))


def json_differences(ours: bytes, theirs: bytes) -> list[str]:
    """Where the `sockets --json` rows of two records differ, read at the same moment;
    fields that count seconds may differ by the clocks' rounding."""
    now_ns = time.monotonic_ns()
    rows = [
        socket_json(record_to_sample(KvSockRecord.from_buffer_copy(raw), now_ns), now_ns, POLICY)
        for raw in (ours, theirs)
    ]
    return [
        f"{name}: {value!r} vs {rows[1][name]!r}"
        for name, value in rows[0].items()
        if value != rows[1][name]
        and not (name.endswith("_seconds") and abs(value - rows[1][name]) <= SECONDS_TOLERANCE)
    ]


def test_both_layouts_hold_the_same_records_and_json(layouts: Layouts) -> None:
    assert layouts.storage.report.storage == "sk_storage"
    assert layouts.hashed.report.storage == "lru_hash"
    clients = {kind: layouts.scenario.connect(kind) for kind in ("healthy", "slow", "stalled")}
    wait_for_server_side(
        layouts.storage, clients["stalled"].local_port, in_zero_window, 5.0, "a zero window"
    )
    for client in clients.values():
        client.close()
    clients = {kind: layouts.scenario.connect(kind) for kind in ("stalled", "idle")}
    wait_for_server_side(
        layouts.hashed, clients["stalled"].local_port, in_zero_window, 5.0, "a zero window"
    )
    records = agreeing(layouts)
    assert len(records) == 2
    for key, (ours, theirs) in records.items():
        assert json_differences(ours, theirs) == [], hex(key)
    for client in clients.values():
        client.close()


def test_both_layouts_send_the_same_edge_events(layouts: Layouts) -> None:
    logs = EventLog(layouts.storage), EventLog(layouts.hashed)
    client = layouts.scenario.connect("stalled")
    wait_for(lambda: "zero_window_start" in logs[1].kinds_for(client.local_port), 5.0, "a stall")
    client.start_reading()
    wait_for(lambda: "zero_window_end" in logs[1].kinds_for(client.local_port), 5.0, "the end")
    client.close()
    wait_for(
        lambda: all("close" in log.kinds_for(client.local_port) for log in logs),
        5.0,
        "the close event in both layouts",
    )
    kinds = [log.kinds_for(client.local_port) for log in logs]
    assert kinds[0] == kinds[1]


def test_the_iterator_reads_every_record_once(layouts: Layouts) -> None:
    """Many records, read whole: every one comes back once, keyed by its socket."""
    clients = [layouts.scenario.connect("idle") for _ in range(200)]
    layouts.scenario.wait_for_server_sockets(200, timeout_seconds=30)
    size = ctypes.sizeof(KvSockRecord)
    found = wait_for(
        lambda: (n := len(layouts.storage.programs.table.read_all()) // size) >= 200 and n,
        5.0,
        "200 records",
    )
    assert found == 200
    assert len(records_by_key(layouts.storage.programs.table.read_all())) == 200
    for client in clients:
        client.close()
