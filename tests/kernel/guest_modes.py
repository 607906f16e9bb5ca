"""The kernel matrix's subset of the socket scenarios, run once per attach-mode pair.

Runs inside each matrix VM and directly on the CI kernel (scripts/kernel_matrix); the name
keeps it out of the default collection, so `make test` runs it through the matrix only. Each
pair of modes the kernel offers is forced in turn (tests/kernel/plan.py); a pair the kernel
refuses must be refused by kvwatch's loader too, and is reported unavailable with the reason.
Timeouts are wider than tests/collect/bpf's: under software emulation the guest runs ~30x slower.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvwatch.collect.bpf.collector import BpfCollector, SocketEvent
from kvwatch.collect.bpf.loader import BTF_SEND_MODES, SEND_MODES, BpfPrograms, CollectorSettings
from kvwatch.collect.diag.wire import parse_tcp_info
from kvwatch.errors import BpfError
from kvwatch.lab.harness.scenario import Scenario, ScenarioClient, abort
from kvwatch.lab.waiting import wait_for
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.states import StallThresholds, StreamState, classify
from tests.collect.bpf.conftest import EventLog
from tests.kernel.conftest import libbpf_log
from tests.kernel.kernel_offers import storage_iterator_refusal
from tests.kernel.plan import Combo, Offers, best_send_mode, best_tracepoint_mode

pytestmark = pytest.mark.bpf
POLICY = StallThresholds(stall_seconds=2.0)
WATCH_SECONDS = 2 * POLICY.stall_seconds + 0.5
TCP_CLOSE = 7
SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
BPF_RET_CONSTANT = 0x06
LOG_LINES = 60


@dataclass
class Watched:
    """A collector forced into one mode pair, watching an IPv4 and an IPv6 scenario server.
    Owned by the module-scoped fixture, which closes all three."""

    collector: BpfCollector
    v4: Scenario
    v6: Scenario
    events: EventLog


def load_forced(combo: Combo, ports: tuple[int, ...] = (), pid: int = 0) -> BpfCollector:
    """Loads the pair, or skips it as unavailable when both the kernel and kvwatch refuse it."""
    settings = CollectorSettings(
        ports=ports, pid=pid, send_mode=combo.send, tracepoint_mode=combo.tracepoint
    )
    with libbpf_log() as lines:
        try:
            collector = BpfCollector(settings)
        except BpfError as exc:
            if combo.unavailable:
                pytest.skip(f"unavailable: {combo.unavailable}")
            log = "\n".join(lines[-LOG_LINES:])
            pytest.fail(f"kvwatch refused {combo.id}, which the kernel offers: {exc}\n{log}")
    if combo.unavailable:
        collector.close()
        pytest.fail(f"{combo.id} loaded although the kernel refused it: {combo.unavailable}")
    return collector


@pytest.fixture(scope="module")
def watched(combo: Combo) -> Iterator[Watched]:
    with Scenario() as v4, Scenario(family=socket.AF_INET6) as v6:
        collector = load_forced(combo, (v4.port, v6.port))
        try:
            yield Watched(collector, v4, v6, EventLog(collector))
        finally:
            collector.close()


def endpoint_of(client: ScenarioClient) -> Endpoint:
    host, port = client.sock.getsockname()[:2]
    return Endpoint(host, port)


def server_side(collector: BpfCollector, client: ScenarioClient) -> SocketSample | None:
    return server_side_of(collector, endpoint_of(client))


def server_side_of(collector: BpfCollector, peer: Endpoint) -> SocketSample | None:
    return next((s for s in collector.samples() if s.remote == peer), None)


def wait_for_sample(
    collector: BpfCollector, client: ScenarioClient, what: str, timeout_seconds: float
) -> SocketSample:
    found = wait_for(
        lambda: (s := server_side(collector, client)) is not None and s.zero_window and s,
        timeout_seconds,
        what,
    )
    assert isinstance(found, SocketSample)
    return found


def kernels_peer_window(scenario: Scenario, client: ScenarioClient) -> int | None:
    """The peer window the kernel itself reports (tcp_info) for the server side of `client`."""
    peer = client.sock.getsockname()[:2]
    server = next(s for s in scenario.server_sockets if s.getpeername()[:2] == peer)
    return parse_tcp_info(server.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 512)).snd_wnd


def first_event(events: EventLog, kind: str, peer: Endpoint) -> SocketEvent | None:
    return next((e for e in events.drain() if e.kind == kind and e.sample.remote == peer), None)


def test_points_attach_in_the_forced_modes(watched: Watched, combo: Combo, offers: Offers) -> None:
    assert watched.collector.report.points == combo.point_modes(offers)
    typed = combo.send in BTF_SEND_MODES and combo.tracepoint == "tp_btf"
    # Socket storage where every program is BTF-typed and the kernel lets its table be read
    # through an iterator; else the LRU hash (the loader keeps the modes either way).
    storage_readable = storage_iterator_refusal() is None
    assert watched.collector.report.storage == (
        "sk_storage" if typed and storage_readable else "lru_hash"
    )


@pytest.mark.exercises("send", "ack", "zero_window_probe")
def test_stalled_client_is_found_but_not_a_slow_or_an_idle_one(
    watched: Watched, combo: Combo
) -> None:
    """The guarantee of docs/contracts.md (a live reader is never stalled), all three
    clients at once to keep the matrix short."""
    scenario, collector = watched.v4, watched.collector
    clients = {kind: scenario.connect(kind) for kind in ("stalled", "slow", "idle")}
    seen: dict[str, set[StreamState]] = {kind: set() for kind in clients}
    slow_zero_windows = 0
    deadline = time.monotonic() + WATCH_SECONDS
    while time.monotonic() < deadline:
        now = time.monotonic_ns()
        for kind, client in clients.items():
            sample = server_side(collector, client)
            if sample is not None:
                seen[kind].add(classify(sample, now, POLICY))
                slow_zero_windows += kind == "slow" and sample.zero_window
        time.sleep(0.05)  # deliberate: a look every 50 ms for WATCH_SECONDS
    stalled = server_side(collector, clients["stalled"])
    idle = server_side(collector, clients["idle"])
    assert stalled is not None and idle is not None
    assert StreamState.STALLED in seen["stalled"], seen
    assert stalled.pid == os.getpid() and stalled.comm, "the send attach point names the writer"
    assert stalled.pending_bytes > 0 and stalled.zero_window_episodes == 1
    assert StreamState.STALLED not in seen["slow"], seen
    assert clients["slow"].bytes_read > 0 and slow_zero_windows > 0
    assert StreamState.STALLED not in seen["idle"], seen
    assert idle.pending_bytes == 0
    assert idle.peer_rwnd == kernels_peer_window(scenario, clients["idle"]), "scaled as the kernel"
    probes_counted = watched.collector.report.points["zero_window_probe"] != "unavailable"
    assert (stalled.zero_window_probes > 0) == probes_counted, stalled.zero_window_probes
    for client in clients.values():
        client.close()


@pytest.mark.exercises("ack")
def test_reading_again_ends_the_zero_window_episode(watched: Watched) -> None:
    client = watched.v4.connect("stalled")
    wait_for_sample(watched.collector, client, "a zero window", 3.0)
    time.sleep(1.0)  # deliberate: the episode lasts a second
    resumed_ns = time.monotonic_ns()
    client.start_reading()
    peer = endpoint_of(client)
    ended = wait_for(
        lambda: first_event(watched.events, "zero_window_end", peer), 3.0, "the window reopening"
    )
    assert isinstance(ended, SocketEvent)
    assert (ended.ts_ns - resumed_ns) / 1e9 < 0.5, "the window update itself ends the episode"
    assert ended.sample.zero_window_episodes == 1
    assert 0.9 <= ended.sample.zero_window_total_ns / 1e9 <= 2.0
    client.close()


@pytest.mark.exercises("lifecycle")
def test_close_removes_the_record_with_a_close_event(watched: Watched) -> None:
    client = watched.v4.connect("healthy")
    peer = endpoint_of(client)
    wait_for(lambda: server_side_of(watched.collector, peer), 3.0, "the record")
    client.close()
    closed = wait_for(lambda: first_event(watched.events, "close", peer), 5.0, "a close event")
    assert isinstance(closed, SocketEvent)
    assert closed.sample.tcp_state == TCP_CLOSE
    assert closed.sample.local.port == watched.v4.port
    assert server_side_of(watched.collector, peer) is None
    assert watched.collector.stats()["records_deleted"] >= 1


@pytest.mark.exercises("send")
def test_a_write_after_the_peers_reset_leaves_no_record(combo: Combo) -> None:
    """A streaming server's next write to a client that reset its connection (the usual way a
    client leaves) fails; it must not bring back the record the close removed. Filtered by pid,
    not port: once closed the socket has no local port, so a port filter would hide the bug."""
    collector = load_forced(combo, pid=os.getpid())
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    peer = Endpoint(*client.getsockname())
    try:
        server.sendall(b"data: token\n\n")
        wait_for(lambda: server_side_of(collector, peer), 3.0, "the record")
        abort(client)
        wait_for(lambda: server_side_of(collector, peer) is None, 10.0, "the record removed")
        with pytest.raises(OSError):
            for _ in range(2):
                server.send(b"data: next token\n\n")
        time.sleep(0.2)  # deliberate: room for the record to come back, were it to
        revived = server_side_of(collector, peer)
        assert revived is None, f"a closed socket's record came back: {revived}"
    finally:
        for sock in (server, listener):
            sock.close()
        collector.close()


def drop_everything(sock: socket.socket) -> None:
    """Attaches a classic socket filter that drops every segment arriving for `sock`: TCP
    runs it before processing, so nothing is ACKed and the peer has to retransmit."""
    program = ctypes.create_string_buffer(struct.pack("HBBI", BPF_RET_CONSTANT, 0, 0, 0))
    sock.setsockopt(
        socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HxxxxxxQ", 1, ctypes.addressof(program))
    )


@pytest.mark.exercises("retransmit")
def test_lost_segments_are_counted_as_retransmits(watched: Watched) -> None:
    client = watched.v4.connect("healthy")
    peer = endpoint_of(client)
    wait_for(lambda: server_side_of(watched.collector, peer), 3.0, "the record")
    drop_everything(client.sock)
    retransmitted = wait_for(
        lambda: (s := server_side_of(watched.collector, peer)) and s.retransmits > 0 and s,
        5.0,
        "a retransmission",
    )
    assert isinstance(retransmitted, SocketSample)
    client.sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    client.close()


@pytest.mark.exercises("send", "ack")
def test_ipv6_stalled_client_is_tracked(watched: Watched) -> None:
    client = watched.v6.connect("stalled")
    sample = wait_for_sample(watched.collector, client, "an IPv6 zero window", 3.0)
    assert str(sample.local) == f"[::1]:{watched.v6.port}"
    assert sample.remote == endpoint_of(client)
    assert sample.pid == os.getpid()
    client.close()


def test_auto_picks_the_best_mode_the_kernel_offers(
    offers: Offers, record_property: Callable[[str, object], None]
) -> None:
    """fentry > kprobe > tp_btf > raw_tp for the send path; tp_btf > raw_tp for tracepoints."""
    with BpfPrograms(CollectorSettings()) as programs:
        report = programs.report
    record_property("auto", report.describe())
    best = best_send_mode(offers)
    assert report.send_mode == best
    assert report.points["ack"] == best_tracepoint_mode(offers)
    assert best is not None
    assert set(report.rejected) == set(SEND_MODES[: SEND_MODES.index(best)])
