"""DiagTracker: episode, progress and probe semantics, on built snapshots and real sockets."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Any

from kvwatch.collect.diag import PEER_RWND_UNKNOWN, DiagClient, DiagEntry, DiagSnapshot, DiagTracker
from kvwatch.collect.diag.wire import TIMER_PERSIST, TcpInfo
from kvwatch.sockets import Endpoint, SocketSample

from .conftest import SMALL_RCVBUF_BYTES, PairFactory, wait_for_entry

SECOND_NS = 1_000_000_000
_INFO = TcpInfo(
    probes=0,
    backoff=0,
    peer_wscale=7,
    rto_us=204_000,
    last_data_sent_ms=0,
    last_ack_recv_ms=0,
    snd_mss=1448,
    unacked_segments=0,
    rtt_us=100,
    snd_cwnd=10,
    total_retrans=0,
    bytes_acked=0,
    notsent_bytes=0,
    bytes_sent=0,
    snd_wnd=65536,
)
_ENTRY = DiagEntry(
    family=socket.AF_INET,
    local=Endpoint("10.0.0.1", 8000),
    remote=Endpoint("10.0.0.2", 40000),
    tcp_state=1,
    timer=0,
    timer_expires_ms=0,
    inode=0,
    uid=0,
    cookie=7,
    send_queue_bytes=0,
    wmem_queued=0,
    sndbuf=100_000,
    tcp_info=_INFO,
)


def _entry(
    send_queue_bytes: int = 0, wmem_queued: int = 0, timer: int = 0, **info: Any
) -> DiagEntry:
    return dataclasses.replace(
        _ENTRY,
        send_queue_bytes=send_queue_bytes,
        wmem_queued=wmem_queued,
        timer=timer,
        tcp_info=dataclasses.replace(_INFO, **info),
    )


def _poll(tracker: DiagTracker, second: float, *entries: DiagEntry) -> list[SocketSample]:
    return tracker.update(DiagSnapshot(int(second * SECOND_NS), 4026531840, entries))


def _one(tracker: DiagTracker, second: float, entry: DiagEntry) -> SocketSample:
    (sample,) = _poll(tracker, second, entry)
    return sample


def test_zero_window_episodes_open_and_close_at_polls() -> None:
    tracker = DiagTracker()
    stuck = _entry(send_queue_bytes=5000, notsent_bytes=5000, snd_wnd=0)
    first = _one(tracker, 10, stuck)
    assert first.zero_window and first.zero_window_since_ns == 10 * SECOND_NS
    assert first.zero_window_episodes == 1
    assert _one(tracker, 12, stuck).zero_window_total_ns == 2 * SECOND_NS
    opened = _one(tracker, 13, _entry(send_queue_bytes=5000, notsent_bytes=5000, snd_wnd=4096))
    assert not opened.zero_window
    assert opened.last_zero_window_end_ns == 13 * SECOND_NS
    assert opened.zero_window_total_ns == 3 * SECOND_NS
    again = _one(tracker, 14, stuck)
    assert (again.zero_window_episodes, again.zero_window_total_ns) == (2, 3 * SECOND_NS)
    assert _one(tracker, 15, stuck).zero_window_total_ns == 4 * SECOND_NS


def test_zero_window_needs_pending_data_and_a_known_window() -> None:
    tracker = DiagTracker()
    assert not _one(tracker, 1, _entry(snd_wnd=0)).zero_window  # nothing to send: idle
    unknown = _one(tracker, 2, _entry(send_queue_bytes=9, notsent_bytes=9, snd_wnd=None))
    assert unknown.peer_rwnd == PEER_RWND_UNKNOWN
    assert not unknown.zero_window


def test_sndbuf_full_episodes() -> None:
    tracker = DiagTracker()
    # Full means "not writable": more than 2/3 of sndbuf (100,000 here) queued.
    assert _one(tracker, 1, _entry(wmem_queued=66_667)).sndbuf_full
    assert not _one(tracker, 2, _entry(wmem_queued=66_666)).sndbuf_full
    full = _one(tracker, 3, _entry(wmem_queued=120_000))
    assert (full.sndbuf_full_episodes, full.sndbuf_full_since_ns) == (2, 3 * SECOND_NS)


def test_progress_follows_acks_and_new_data() -> None:
    tracker = DiagTracker()
    idle = _one(tracker, 1, _entry(bytes_acked=100))
    assert idle.progress_ns == idle.first_seen_ns == SECOND_NS
    assert idle.no_progress_seconds(100 * SECOND_NS) == 0.0
    pending = _entry(send_queue_bytes=50, notsent_bytes=50, bytes_acked=100)
    assert _one(tracker, 5, pending).progress_ns == 5 * SECOND_NS  # data became pending
    stuck = _one(tracker, 9, pending)
    assert stuck.progress_ns == 5 * SECOND_NS
    assert stuck.no_progress_seconds(9 * SECOND_NS) == 4.0
    moved = _one(tracker, 10, _entry(send_queue_bytes=50, notsent_bytes=40, bytes_acked=110))
    assert (moved.progress_ns, moved.bytes_acked) == (10 * SECOND_NS, 110)
    assert (moved.notsent_bytes, moved.unacked_bytes) == (40, 10)


def test_probes_count_backoff_growth_under_the_persist_timer() -> None:
    tracker = DiagTracker()
    probing = {"send_queue_bytes": 10, "notsent_bytes": 10, "snd_wnd": 0, "timer": TIMER_PERSIST}
    assert _one(tracker, 1, _entry(backoff=2, **probing)).zero_window_probes == 0
    assert _one(tracker, 2, _entry(backoff=4, **probing)).zero_window_probes == 2
    assert _one(tracker, 3, _entry(backoff=6)).zero_window_probes == 2  # RTO backoff, no probe
    assert _one(tracker, 4, _entry(backoff=1, **probing)).zero_window_probes == 3  # reset


def test_vanished_sockets_are_dropped() -> None:
    tracker = DiagTracker()
    other = dataclasses.replace(_ENTRY, cookie=8)
    assert len(_poll(tracker, 1, _ENTRY, other)) == 2
    assert len(tracker) == 2
    samples = _poll(tracker, 2, other)
    assert [sample.key for sample in samples] == [8]
    assert len(tracker) == 1
    assert _one(tracker, 3, _ENTRY).first_seen_ns == 3 * SECOND_NS  # a new socket to the tracker


def _track(client: DiagClient, tracker: DiagTracker, port: int, cookie: int) -> SocketSample:
    samples = tracker.update(client.snapshot(local_ports=[port]))
    return next(sample for sample in samples if sample.key == cookie)


def test_reader_resuming_ends_the_episode(tcp_pair: PairFactory, diag_client: DiagClient) -> None:
    pair = tcp_pair(client_rcvbuf=SMALL_RCVBUF_BYTES)
    written = pair.fill()
    wait_for_entry(diag_client, pair, lambda e: e.tcp_info.snd_wnd == 0)
    tracker = DiagTracker()
    stalled = _track(diag_client, tracker, pair.port, pair.server_cookie)
    assert stalled.zero_window and stalled.zero_window_episodes == 1
    received = 0
    while received < written:
        received += len(pair.client.recv(1 << 20))
    wait_for_entry(diag_client, pair, lambda e: e.notsent_bytes + e.unacked_bytes == 0)
    resumed = _track(diag_client, tracker, pair.port, pair.server_cookie)
    assert not resumed.zero_window and resumed.zero_window_episodes == 1
    assert resumed.last_zero_window_end_ns == resumed.observed_ns
    assert resumed.zero_window_total_ns == resumed.observed_ns - stalled.zero_window_since_ns
    assert resumed.progress_ns == resumed.observed_ns


def test_slow_reader_keeps_making_progress(tcp_pair: PairFactory, diag_client: DiagClient) -> None:
    pair = tcp_pair(client_rcvbuf=SMALL_RCVBUF_BYTES)
    stop = threading.Event()

    def write() -> None:
        pair.server.settimeout(0.2)
        while not stop.is_set():
            try:
                pair.server.send(b"t" * 4096)
            except TimeoutError:
                continue

    def read() -> None:
        while not stop.wait(0.1):
            pair.client.recv(2048)

    pair.threads += [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in pair.threads:
        thread.start()
    tracker, worst_stall_seconds, progress_marks = DiagTracker(), 0.0, set()
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            sample = _track(diag_client, tracker, pair.port, pair.server_cookie)
            progress_marks.add(sample.progress_ns)
            worst_stall_seconds = max(
                worst_stall_seconds, sample.no_progress_seconds(sample.observed_ns)
            )
            time.sleep(0.05)  # deliberate: a look every 50 ms for 2.5 s
    finally:
        stop.set()
        for thread in pair.threads:
            thread.join(timeout=5)
    assert sample.pending_bytes > 0
    assert len(progress_marks) >= 4
    assert worst_stall_seconds < 1.0
