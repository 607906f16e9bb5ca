"""The check before an action (kvwatch.act.confirm) against real sockets: the kernel's view
of a stalled connection confirms the stall; a reader that drained since, a sender that
closed and a connection that is gone do not, and say why."""

from __future__ import annotations

import contextlib
import time

from kvwatch.act.confirm import check
from kvwatch.collect.diag.kernel_view import CheckedViews
from kvwatch.lab.waiting import wait_until
from kvwatch.streams.states import StallThresholds, judge
from tests.act.stalled import StalledConnections, kernel_view

POLICY = StallThresholds()


def test_a_stalled_connection_is_confirmed_with_the_kernels_evidence(
    stalled_connections: StalledConnections,
) -> None:
    record = stalled_connections.sample(key=1, pid=1)
    now = time.monotonic_ns()
    entry = kernel_view(record.local, record.remote)
    verdict = check(record, judge(record, now, POLICY), entry, now, now, POLICY, CheckedViews())
    assert verdict.agrees and verdict.judgement.stalled
    assert verdict.kernel is not None and verdict.kernel["tcp_state"] == "ESTABLISHED"
    assert verdict.kernel["peer_rwnd"] == 0 and verdict.kernel["notsent_bytes"] > 0
    # the answers to the kernel's probes are newer than the record's minute-old segment
    assert verdict.sample.last_ack_ns > record.last_ack_ns


def test_a_reader_that_drained_since_the_record_is_not_stalled(
    stalled_connections: StalledConnections,
) -> None:
    record = stalled_connections.sample(key=1, pid=1)
    reader = stalled_connections.reader
    reader.settimeout(0.2)
    with contextlib.suppress(TimeoutError):
        while reader.recv(65536):  # everything queued, however many reads it takes
            pass
    wait_until(
        lambda: kernel_view(record.local, record.remote).tcp_info.bytes_acked > record.bytes_acked,
        2,
        "the kernel to see the drained bytes acknowledged",
    )
    now = time.monotonic_ns()
    entry = kernel_view(record.local, record.remote)
    verdict = check(record, judge(record, now, POLICY), entry, now, now, POLICY, CheckedViews())
    assert not verdict.agrees and verdict.reason == "unconfirmed"
    assert "more bytes acknowledged" in verdict.detail
    assert verdict.sample.bytes_acked > record.bytes_acked


def test_a_sender_that_closed_is_not_stalled(stalled_connections: StalledConnections) -> None:
    record = stalled_connections.sample(key=1, pid=1)
    stalled_connections.writer.close()  # queued bytes left: FIN_WAIT1, an orphan
    now = time.monotonic_ns()
    entry = kernel_view(record.local, record.remote)
    verdict = check(record, judge(record, now, POLICY), entry, now, now, POLICY, CheckedViews())
    assert not verdict.agrees and verdict.reason == "unconfirmed"
    assert "the sender has closed (FIN_WAIT1)" in verdict.detail
    assert verdict.kernel is not None and verdict.kernel["tcp_state"] == "FIN_WAIT1"


def test_a_connection_that_is_gone_is_said_to_be(stalled_connections: StalledConnections) -> None:
    record = stalled_connections.sample(key=1, pid=1)
    now = time.monotonic_ns()
    verdict = check(record, judge(record, now, POLICY), None, now, now, POLICY, CheckedViews())
    assert (verdict.agrees, verdict.reason, verdict.kernel) == (False, "socket_gone", None)


def test_progress_the_record_missed_is_dated_from_the_check_that_first_showed_it(
    stalled_connections: StalledConnections,
) -> None:
    """A record that never sees the peer's ACKs (CLOSE_WAIT: not on the ACK path) is not
    made young forever by the kernel's ever-newer probe answers: once two checks count the
    same bytes acknowledged, nothing has moved since the first of them."""
    record = stalled_connections.sample(key=1, pid=1).with_changes(bytes_acked=0)
    checked = CheckedViews()
    entry = kernel_view(record.local, record.remote)
    first = time.monotonic_ns()
    verdict = check(record, judge(record, first, POLICY), entry, first, first, POLICY, checked)
    assert not verdict.agrees and "more bytes acknowledged" in verdict.detail
    progress_by = verdict.sample.progress_ns
    later = first + 60 * 1_000_000_000  # the same count a minute on
    again = check(record, judge(record, later, POLICY), entry, later, later, POLICY, checked)
    assert again.sample.progress_ns == progress_by
    assert again.agrees
