"""The judge (kvwatch.streams.states.judge) and the probe schedule it reads
(kvwatch.collect.probes), on hand-made samples: the arithmetic behind the reader guarantee of
docs/collector.md."""

from __future__ import annotations

from kvwatch.collect.probes import (
    TCP_RTO_MAX_NS,
    answer_after_ns,
    persist_elapsed_ns,
    probe_interval_ns,
)
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.states import StallThresholds, StreamState, classify, judge

S = 1_000_000_000
MS = 1_000_000
POLICY = StallThresholds(stall_seconds=3.0, min_reader_bytes_per_second=4096)


def zero_window(**changes: object) -> SocketSample:
    """A socket whose peer closed its window at t = 100 s (its last segment) with 8 KB
    queued; the peer advertised at most 32 KB and acknowledged 1 MB in all; RTO 200 ms, no
    RTT."""
    base = SocketSample(
        key=1, source="bpf", observed_ns=100 * S, local=Endpoint("10.0.0.1", 8000),
        remote=Endpoint("10.0.0.2", 50000), netns=1, inode=1, pid=10, comm="engine",
        tcp_state=1, wmem_queued=9000, sndbuf=87040, notsent_bytes=8192, unacked_bytes=0,
        peer_rwnd=0, srtt_us=0, snd_cwnd=10, retransmits=0, zero_window_probes=0,
        zero_window_episodes=1, zero_window_since_ns=100 * S, zero_window_total_ns=0,
        last_zero_window_end_ns=0, sndbuf_full_episodes=0, sndbuf_full_since_ns=0,
        progress_ns=100 * S, first_seen_ns=50 * S, bytes_acked=1 << 20, peer_rwnd_max=32768,
        rto_us=200_000, last_ack_ns=100 * S,
    )  # fmt: skip
    return base.with_changes(**changes)


def test_the_guarantee_waits_for_a_reader_at_the_rate_to_drain_twice_its_window() -> None:
    # The peer answered the probes at 100.2 and 100.6 s: alive, just not reading.
    sample = zero_window(last_ack_ns=100_600 * MS, probe_backoff=2)
    verdict = judge(sample, 101 * S, POLICY)
    assert verdict.buffer_bytes == 2 * 32768
    assert verdict.drained_ns == 100 * S + 16 * S  # 64 KB at 4 KB/s
    assert not verdict.stalled
    # The answer to the first probe after the drain is due by then (probes at 0.2, 0.6,
    # 1.4, 3.0, 6.2, 12.6, 25.4 s, each up to an eighth late).
    assert 25.4 * S <= verdict.required_ns <= 25.4 * 1.125 * S
    # Looked at again when silence would prove it: before the next-but-one answer is due.
    assert verdict.recheck_ns < 105 * S


def test_an_answer_after_the_drain_that_still_shows_no_progress_proves_the_stall() -> None:
    before = judge(zero_window(last_ack_ns=115 * S, probe_backoff=5), 115 * S, POLICY)
    assert not before.proof  # a live reader could still be draining
    after = judge(zero_window(last_ack_ns=126 * S, probe_backoff=6), 126 * S, POLICY)
    assert after.proof == "answer" and after.stalled
    assert classify(zero_window(last_ack_ns=126 * S), 126 * S, POLICY) is StreamState.STALLED


def test_a_silent_peer_is_stalled_without_waiting_for_the_drain() -> None:
    """No answer to two probes: the peer is gone, not slow."""
    quiet = zero_window()
    assert not judge(quiet, 100 * S + S // 2, POLICY).proof
    verdict = judge(quiet, 104 * S, POLICY)
    assert verdict.proof == "silence" and verdict.stalled
    assert verdict.stalled_seconds(104 * S) < verdict.required_ns / S


def test_stall_seconds_is_a_floor_even_with_proof() -> None:
    tiny = zero_window(peer_rwnd_max=1000, bytes_acked=1000, last_ack_ns=101 * S)
    assert judge(tiny, 101 * S, POLICY).proof == "answer"
    assert not judge(tiny, 102 * S, POLICY).stalled
    assert judge(tiny, 103 * S, POLICY).stalled


def test_never_more_than_it_acknowledged() -> None:
    assert judge(zero_window(bytes_acked=4096), 101 * S, POLICY).buffer_bytes == 4096


def test_without_the_largest_window_the_window_scale_bounds_the_buffer() -> None:
    diag = zero_window(source="inet_diag", peer_rwnd_max=0, peer_wscale=2)
    assert judge(diag, 101 * S, POLICY).buffer_bytes == 65535 << 2


def test_a_higher_rate_cuts_sooner() -> None:
    sample = zero_window(last_ack_ns=100_600 * MS, probe_backoff=2)
    fast = StallThresholds(stall_seconds=3.0, min_reader_bytes_per_second=65536)
    assert judge(sample, 101 * S, fast).required_ns < judge(sample, 101 * S, POLICY).required_ns


def test_no_pending_data_or_no_pressure_is_not_a_stall() -> None:
    assert not judge(zero_window(notsent_bytes=0), 200 * S, POLICY).on_the_way
    assert not judge(zero_window(zero_window_since_ns=0), 200 * S, POLICY).on_the_way


def test_the_schedule_goes_on_from_the_kernels_backoff() -> None:
    base = 200 * MS
    # Anchored at an answer after 4 probes: the next interval is 3.2 s, not 0.2 s, and the
    # timer wheel may fire it up to an eighth late.
    assert answer_after_ns(0, 4, base, 0, 1) == (3_200 * MS, 3_200 * MS + 400 * MS)
    assert probe_interval_ns(base, 20) == TCP_RTO_MAX_NS


def test_persist_elapsed_reads_the_timer_backwards() -> None:
    # Five probes sent (0.2 + 0.4 + 0.8 + 1.6 + 3.2 s), the sixth interval (6.4 s) has 0.6 s
    # to go: the zero window is 6.2 + 5.8 = 12.0 s old.
    assert persist_elapsed_ns(5, 200_000, 600) == 12_000 * MS
    assert persist_elapsed_ns(0, 200_000, 200) == 0
