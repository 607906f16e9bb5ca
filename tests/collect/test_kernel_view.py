"""Folding the kernel's view of a socket (tcp_info) into its record
(kvwatch.collect.diag.kernel_view): only towards "not stalled", and with the probe schedule
the judge needs — the backoff as of the newest answer, not as of now."""

from __future__ import annotations

import time

from kvwatch.collect.diag.kernel_view import CheckedViews, with_kernel_view
from kvwatch.collect.diag.wire import DiagEntry, TcpInfo
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.states import StallThresholds, judge

S = 1_000_000_000
CLOSE_WAIT = 8


def record(now: int) -> SocketSample:
    """A half-closed client's socket as BPF last saw it, 30 s ago: window shut, buffer full."""
    since = now - 30 * S
    return SocketSample(
        key=1, source="bpf", observed_ns=now, local=Endpoint("10.0.0.1", 8000),
        remote=Endpoint("10.0.0.2", 50000), netns=1, inode=1, pid=1, comm="engine",
        tcp_state=CLOSE_WAIT, wmem_queued=9000, sndbuf=9000, notsent_bytes=4096,
        unacked_bytes=0, peer_rwnd=0, srtt_us=1000, snd_cwnd=10, retransmits=0,
        zero_window_probes=0, zero_window_episodes=1, zero_window_since_ns=since,
        zero_window_total_ns=0, last_zero_window_end_ns=0, sndbuf_full_episodes=1,
        sndbuf_full_since_ns=since, progress_ns=since, first_seen_ns=since,
        bytes_acked=100_000, peer_rwnd_max=65536, rto_us=200_000, probe_backoff=2,
        last_ack_ns=since,
    )  # fmt: skip


def kernel(last_ack_recv_ms: int, backoff: int, probes: int, bytes_acked: int) -> DiagEntry:
    info = TcpInfo(
        probes=probes, backoff=backoff, peer_wscale=7, rto_us=200_000, last_data_sent_ms=0,
        last_ack_recv_ms=last_ack_recv_ms, snd_mss=1448, unacked_segments=0, rtt_us=1000,
        snd_cwnd=10, total_retrans=0, bytes_acked=bytes_acked, notsent_bytes=4096,
        bytes_sent=None, snd_wnd=0,
    )  # fmt: skip
    return DiagEntry(
        family=2, local=Endpoint("10.0.0.1", 8000), remote=Endpoint("10.0.0.2", 50000),
        tcp_state=CLOSE_WAIT, timer=4, timer_expires_ms=100, inode=1, uid=0, cookie=1,
        send_queue_bytes=4096, wmem_queued=9000, sndbuf=9000, tcp_info=info,
    )  # fmt: skip


def test_a_peer_gone_since_its_last_answer_is_proven_silent_from_that_answer() -> None:
    """The link went down 8 s ago: the kernel has sent 5 probes since its newest answer
    (backoff 6). Timed from that answer with the backoff then (1), two probes went
    unanswered long ago; timed with today's backoff, the proof would wait minutes."""
    now = time.monotonic_ns()
    entry = kernel(last_ack_recv_ms=8000, backoff=6, probes=5, bytes_acked=100_000)
    folded = with_kernel_view(record(now), entry, now, 0)
    assert folded.probe_backoff == 1 and folded.last_ack_ns == now - 8 * S
    verdict = judge(folded, now, StallThresholds())
    assert verdict.stalled and verdict.proof == "silence"


def test_progress_the_record_missed_makes_it_young_again() -> None:
    now = time.monotonic_ns()
    entry = kernel(last_ack_recv_ms=100, backoff=0, probes=0, bytes_acked=150_000)
    folded = CheckedViews().refresh(record(now), entry, now)
    assert folded.bytes_acked == 150_000 and folded.progress_ns == now - 100_000_000
    assert not judge(folded, now, StallThresholds()).stalled


def test_the_record_is_never_made_older() -> None:
    now = time.monotonic_ns()
    fresh = record(now).with_changes(last_ack_ns=now, bytes_acked=200_000, probe_backoff=3)
    entry = kernel(last_ack_recv_ms=5000, backoff=7, probes=4, bytes_acked=150_000)
    folded = with_kernel_view(fresh, entry, now, 0)
    assert (folded.last_ack_ns, folded.bytes_acked, folded.probe_backoff) == (now, 200_000, 3)
