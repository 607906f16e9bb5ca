"""The guarantee of docs/contracts.md (a live reader is never stalled), proven on real
sockets: a stalled client is found; a slow reader that keeps draining and an idle connection
never are."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from kvwatch.collect.bpf.collector import BpfCollector, SocketEvent
from kvwatch.lab.harness.scenario import Scenario
from kvwatch.lab.waiting import wait_for
from kvwatch.sockets import SocketSample
from kvwatch.streams.states import StallThresholds, StreamState, classify
from tests.collect.bpf.conftest import EventLog, in_zero_window, server_side, wait_for_server_side

pytestmark = pytest.mark.bpf
POLICY = StallThresholds(stall_seconds=3.0)


def is_stalled(sample: SocketSample) -> bool:
    return classify(sample, time.monotonic_ns(), POLICY) is StreamState.STALLED


def test_stalled_client_is_found(
    scenario: Scenario, open_collector: Callable[..., BpfCollector]
) -> None:
    collector = open_collector(ports=(scenario.port,))
    client = scenario.connect("stalled")

    first = wait_for_server_side(
        collector, client.local_port, in_zero_window, 1.0, "a zero window within 1 s"
    )
    assert first.peer_rwnd == 0
    assert first.pid == os.getpid()
    assert first.comm
    assert str(first.local) == f"127.0.0.1:{scenario.port}"
    assert str(first.remote) == f"127.0.0.1:{client.local_port}"
    assert first.pending_bytes > 0
    assert first.zero_window_episodes == 1

    time.sleep(0.5)  # deliberate: half a second later, still a zero window, not yet stalled
    later = server_side(collector, client.local_port)
    assert later is not None
    assert later.pending_bytes >= first.pending_bytes, "the send queue keeps growing or holds"
    assert classify(later, time.monotonic_ns(), POLICY) is StreamState.ZERO_WINDOW

    stalled = wait_for_server_side(
        collector, client.local_port, is_stalled, POLICY.stall_seconds + 1.0, "the stalled state"
    )
    assert stalled.no_progress_seconds(time.monotonic_ns()) >= POLICY.stall_seconds
    assert stalled.zero_window_seconds(time.monotonic_ns()) >= POLICY.stall_seconds - 0.5


def test_slow_draining_reader_and_idle_connection_are_never_stalled(
    scenario: Scenario, open_collector: Callable[..., BpfCollector]
) -> None:
    collector = open_collector(ports=(scenario.port,))
    slow = scenario.connect("slow")
    idle = scenario.connect("idle")
    seen: dict[str, set[StreamState]] = {"slow": set(), "idle": set()}
    zero_window_polls = polls = 0
    deadline = time.monotonic() + 2 * POLICY.stall_seconds + 1
    while time.monotonic() < deadline:
        now = time.monotonic_ns()
        for kind, client in (("slow", slow), ("idle", idle)):
            sample = server_side(collector, client.local_port)
            if sample is None:
                continue
            seen[kind].add(classify(sample, now, POLICY))
            if kind == "slow":
                polls += 1
                zero_window_polls += sample.zero_window
        time.sleep(0.05)  # deliberate: a look every 50 ms over two stall thresholds
    assert slow.bytes_read > 0
    assert StreamState.STALLED not in seen["slow"], seen
    assert zero_window_polls / max(polls, 1) > 0.3, "the slow reader should hit zero windows"
    assert StreamState.STALLED not in seen["idle"], seen
    idle_sample = server_side(collector, idle.local_port)
    assert idle_sample is not None and idle_sample.pending_bytes == 0


def test_reading_again_ends_the_zero_window_episode(
    scenario: Scenario, open_collector: Callable[..., BpfCollector]
) -> None:
    collector = open_collector(ports=(scenario.port,))
    events = EventLog(collector)
    client = scenario.connect("stalled")
    wait_for_server_side(collector, client.local_port, in_zero_window, 1.0, "a zero window")
    time.sleep(1.0)  # deliberate: the episode lasts a second
    resumed_ns = time.monotonic_ns()
    client.start_reading()

    ended: SocketEvent = wait_for(
        lambda: next(
            (
                e
                for e in events.drain()
                if e.kind == "zero_window_end" and e.sample.remote.port == client.local_port
            ),
            None,
        ),
        1.0,
        "the zero-window end event",
    )
    assert (ended.ts_ns - resumed_ns) / 1e9 < 0.1, "the window update itself ends the episode"
    sample = ended.sample
    assert sample.zero_window_episodes == 1
    assert 0.9 <= sample.zero_window_total_ns / 1e9 <= 1.5
    assert events.kinds_for(client.local_port)[0] in ("zero_window_start", "sndbuf_full_start")


def test_each_answer_to_a_zero_window_probe_is_an_event(
    scenario: Scenario, open_collector: Callable[..., BpfCollector]
) -> None:
    """The peer's answers to the zero-window probes (0.2, 0.6, 1.4 s …) come as events, with
    the record's last-segment time and the kernel's probe backoff: the judge's proof that a
    stalled reader did not move arrives when it happens, not at a poll."""
    collector = open_collector(ports=(scenario.port,))
    events = EventLog(collector)
    client = scenario.connect("stalled")
    wait_for_server_side(collector, client.local_port, in_zero_window, 1.0, "a zero window")

    def answers_so_far() -> list[SocketEvent]:
        return [
            e
            for e in events.drain()
            if e.kind == "zero_window_answer" and e.sample.remote.port == client.local_port
        ]

    # Two answers come within 0.6 s of the window closing; a loaded machine may delay the
    # probes, so wait for them up to the fourth probe (3.0 s) rather than a fixed time.
    try:
        wait_for(lambda: len(answers_so_far()) >= 2, 3.2, "two answers to zero-window probes")
    except AssertionError as exc:
        raise AssertionError(events.kinds_for(client.local_port)) from exc
    answers = answers_so_far()
    assert all(a.sample.zero_window and a.sample.last_ack_ns == a.ts_ns for a in answers)
    assert answers[-1].sample.probe_backoff > answers[0].sample.probe_backoff
