"""The socket table's pure parts (kvwatch.collect.collectors) on hand-made samples: which samples
name one connection (`connection_key`), what a BPF sample keeps of the sock_diag bootstrap
sample that saw the same socket first (`carry_bootstrap`: the older clocks, so a socket that
was stalled before the agent started is not timed from zero again), and the --max-sockets
advice (`TableStatus`, `needed_sockets`). `MergedCollector` itself is not driven here: it
takes a concrete `BpfCollector`, which loads the BPF programs; it is covered end to end
(tests/verdicts)."""

from __future__ import annotations

import pytest

from kvwatch.collect.collectors import (
    TableStatus,
    carry_bootstrap,
    connection_key,
    needed_sockets,
)
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.episodes import stall_of
from kvwatch.streams.states import StallThresholds, StreamState, classify, judge

S = 1_000_000_000
POLICY = StallThresholds(stall_seconds=3.0, min_reader_bytes_per_second=4096)
START = 1000 * S  # when the agent attached and took its sock_diag bootstrap snapshot
ENGINE = Endpoint("10.0.0.1", 8000)
CLIENT = Endpoint("10.0.0.2", 50000)


def diag_view(**changes: object) -> SocketSample:
    """The bootstrap snapshot of a socket whose peer closed its window 10 s before the agent
    started (the kernel's persist timer told the tracker so), 8 KB pending, 4 KB acked."""
    since = START - 10 * S
    base = SocketSample(
        key=0xC00C1E, source="inet_diag", observed_ns=START, local=ENGINE, remote=CLIENT,
        netns=4026531840, inode=777, pid=10, comm="engine", tcp_state=1, wmem_queued=9000,
        sndbuf=87040, notsent_bytes=8192, unacked_bytes=0, peer_rwnd=0, srtt_us=0,
        snd_cwnd=10, retransmits=3, zero_window_probes=4, zero_window_episodes=1,
        zero_window_since_ns=since, zero_window_total_ns=10 * S, last_zero_window_end_ns=0,
        sndbuf_full_episodes=0, sndbuf_full_since_ns=0, progress_ns=since,
        first_seen_ns=START, bytes_acked=4096, peer_wscale=7,
    )  # fmt: skip
    return base.with_changes(**changes)


def bpf_view(**changes: object) -> SocketSample:
    """BPF's first record of the same socket, made at the first zero-window probe answer one
    second after attaching: its own clocks start there."""
    first = START + 1 * S
    base = SocketSample(
        key=0xFFFF8880DEAD, source="bpf", observed_ns=first, local=ENGINE, remote=CLIENT,
        netns=4026531840, inode=777, pid=10, comm="engine", tcp_state=1, wmem_queued=9000,
        sndbuf=87040, notsent_bytes=8192, unacked_bytes=0, peer_rwnd=0, srtt_us=150,
        snd_cwnd=10, retransmits=0, zero_window_probes=1, zero_window_episodes=1,
        zero_window_since_ns=first, zero_window_total_ns=0, last_zero_window_end_ns=0,
        sndbuf_full_episodes=0, sndbuf_full_since_ns=0, progress_ns=first, first_seen_ns=first,
        bytes_acked=4096, peer_rwnd_max=4096, rto_us=200_000, probe_backoff=5,
        last_ack_ns=first,
    )  # fmt: skip
    return base.with_changes(**changes)


def test_both_views_of_one_connection_share_a_key_though_their_socket_keys_differ() -> None:
    bpf, diag = bpf_view(), diag_view()
    assert bpf.key != diag.key  # a kernel pointer and a socket cookie
    assert connection_key(bpf) == connection_key(diag) == (diag.netns, ENGINE, CLIENT)


def test_the_same_addresses_in_another_namespace_or_direction_are_another_connection() -> None:
    here = connection_key(bpf_view())
    assert connection_key(bpf_view(netns=4026532000)) != here  # a pod reusing the addresses
    assert connection_key(bpf_view(local=CLIENT, remote=ENGINE)) != here  # the client's socket


def test_a_socket_stalled_before_the_agent_started_is_stalled_at_bpfs_first_record() -> None:
    now = START + 2 * S
    bpf = bpf_view()
    assert not judge(bpf, now, POLICY).stalled  # on its own: 1 s of a zero window
    carried = carry_bootstrap(bpf, diag_view())
    verdict = judge(carried, now, POLICY)
    assert verdict.stalled
    assert verdict.since_ns == START - 10 * S  # timed from diag's evidence, not from BPF's
    assert verdict.stalled_seconds(now) == pytest.approx(12.0)
    assert classify(carried, now, POLICY) is StreamState.STALLED


def test_the_older_clocks_are_kept_and_everything_else_is_bpfs() -> None:
    bpf, diag = bpf_view(), diag_view()
    carried = carry_bootstrap(bpf, diag)
    assert carried.progress_ns == diag.progress_ns
    assert carried.first_seen_ns == diag.first_seen_ns
    assert carried.zero_window_since_ns == diag.zero_window_since_ns
    rest = {
        "progress_ns": 0,
        "first_seen_ns": 0,
        "zero_window_since_ns": 0,
        "sndbuf_full_since_ns": 0,
    }
    assert carried.with_changes(**rest) == bpf.with_changes(**rest)
    assert carried.source == "bpf" and carried.key == bpf.key
    assert stall_of(carried) == stall_of(bpf) == stall_of(diag)  # one stall episode


def test_bpfs_clocks_win_where_they_are_older() -> None:
    early = START - 60 * S
    bpf = bpf_view(progress_ns=early, first_seen_ns=early, zero_window_since_ns=early)
    carried = carry_bootstrap(bpf, diag_view())
    assert (carried.progress_ns, carried.first_seen_ns, carried.zero_window_since_ns) == (
        early,
        early,
        early,
    )


@pytest.mark.parametrize(
    ("bpf_since", "diag_since", "carried_since"),
    [
        (5 * S, 2 * S, 2 * S),  # both see the episode open: the earlier start
        (2 * S, 5 * S, 2 * S),
        (5 * S, 0, 5 * S),  # diag saw no episode: BPF's own
        (0, 2 * S, 0),  # BPF sees it closed now: closed, whatever diag saw
        (0, 0, 0),
    ],
    ids=["both-open-diag-earlier", "both-open-bpf-earlier", "diag-closed", "bpf-closed", "none"],
)
def test_an_episode_is_carried_only_while_bpf_sees_it_open(
    bpf_since: int, diag_since: int, carried_since: int
) -> None:
    bpf = bpf_view(zero_window_since_ns=bpf_since, sndbuf_full_since_ns=bpf_since)
    diag = diag_view(zero_window_since_ns=diag_since, sndbuf_full_since_ns=diag_since)
    carried = carry_bootstrap(bpf, diag)
    assert carried.zero_window_since_ns == carried_since
    assert carried.sndbuf_full_since_ns == carried_since


def test_a_window_that_reopened_is_not_judged_on_the_bootstrap_episode() -> None:
    reopened = bpf_view(zero_window_since_ns=0, peer_rwnd=65535, last_zero_window_end_ns=START)
    carried = carry_bootstrap(reopened, diag_view())
    assert not carried.zero_window
    assert not judge(carried, START + 2 * S, POLICY).on_the_way


def test_a_new_table_is_not_full_and_has_seen_no_sweep() -> None:
    table = TableStatus(max_sockets=16384)
    assert (table.tracked, table.evictions, table.full, table.sockets_seen) == (0, 0, False, None)


def test_the_advice_fits_what_the_newest_sweep_saw_with_a_quarter_to_spare() -> None:
    table = TableStatus(max_sockets=1024, tracked=1024, evictions=300, full=True)
    table.sockets_seen = 4000
    assert needed_sockets(table) == 5000


def test_before_any_sweep_the_advice_counts_tracked_and_evicted_records() -> None:
    table = TableStatus(max_sockets=1024, tracked=1024, evictions=976, full=True)
    assert needed_sockets(table) == 2500


def test_a_sweep_that_found_no_watched_socket_is_a_sweep_not_a_missing_one() -> None:
    table = TableStatus(max_sockets=1024, tracked=1024, evictions=976, sockets_seen=0)
    assert needed_sockets(table) == 1024


def test_the_advice_never_asks_for_less_than_the_table_has() -> None:
    assert needed_sockets(TableStatus(max_sockets=16384, tracked=10, sockets_seen=12)) == 16384
    assert needed_sockets(TableStatus(max_sockets=16384)) == 16384
