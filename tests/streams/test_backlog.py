"""The flow meter's backlog of a held stream whose reader's window comes back smaller than the
largest it ever advertised (Linux lowered its threshold while the buffer was full): the
reader that read everything is caught up; one that never read is not."""

from __future__ import annotations

from kvwatch.sockets import SocketSample
from kvwatch.streams.backlog import (
    READING_NS,
    READING_SHORTFALL_SHARE,
    WINDOW_STEADY_NS,
    Backlog,
    FlowMeter,
)
from tests.act.test_episode_runner import WINDOW, streaming

SHRUNK = 20_000  # what the window's largest size lost (85-95 KB of 1 MB on loopback)
T0 = 10**12
STEP_NS = WINDOW_STEADY_NS // 4


def held_looks(meter: FlowMeter, unread: list[int]) -> SocketSample:
    """Feeds the meter one held look per STEP_NS, the reader's window `unread` short of its
    largest in each; returns the last sample."""
    sample = streaming(unread=0, at_ns=T0)
    meter.note(sample)
    for n, short in enumerate(unread, start=1):
        sample = streaming(unread=short, at_ns=T0 + n * STEP_NS)
        meter.note(sample, held=True)
    return sample


def test_a_reader_that_read_all_is_caught_up_though_its_window_came_back_smaller() -> None:
    meter = FlowMeter()
    # Stopped (window closing to nothing), then read all: the window rises and stays smaller.
    last = held_looks(meter, [WINDOW // 2, WINDOW, WINDOW, SHRUNK] + [SHRUNK] * 5)
    assert meter.backlog(last).window_shortfall == 0
    # Released, it reads on: the window at the lower ceiling is no backlog, a closing one is.
    flowing = last.with_changes(observed_ns=last.observed_ns + STEP_NS)
    meter.note(flowing)
    assert meter.backlog(flowing).window_shortfall == 0
    closing = flowing.with_changes(peer_rwnd=WINDOW - SHRUNK - 40_000)
    meter.note(closing)
    assert meter.backlog(closing).window_shortfall == 40_000


def test_a_larger_window_raises_the_ceiling_again() -> None:
    meter = FlowMeter()
    last = held_looks(meter, [WINDOW, SHRUNK] + [SHRUNK] * 5)
    grown = last.with_changes(observed_ns=last.observed_ns + STEP_NS, peer_rwnd=WINDOW - 10_000)
    meter.note(grown)
    smaller = grown.with_changes(peer_rwnd=WINDOW - 30_000)
    meter.note(smaller)
    assert meter.backlog(smaller).window_shortfall == 20_000


def test_a_reader_that_never_read_stays_behind_however_long_it_is_held() -> None:
    meter = FlowMeter()
    last = held_looks(meter, [SHRUNK, WINDOW - 1000] + [WINDOW - 1000] * 20)
    assert meter.backlog(last).window_shortfall == WINDOW - 1000


def test_a_window_still_moving_is_not_a_ceiling() -> None:
    meter = FlowMeter()
    # A slow reader draining while held: its window rises at every look.
    last = held_looks(meter, [WINDOW - 4096 * n for n in range(1, 12)])
    assert meter.backlog(last).window_shortfall == WINDOW - 4096 * 11


def test_a_backlog_at_a_rate_decayed_to_almost_nothing_shows_no_seconds() -> None:
    """A stream that stopped writing: its rate decays towards 0, and 200 KB unread once read
    as 2.7e11 s in `sockets --json`."""
    stopped = Backlog(window_shortfall=4096, in_flight=0, unsent=201380, rate=7.5e-7)
    assert stopped.to_json()["seconds"] is None
    assert Backlog(4096, 0, 4096, rate=4096.0).to_json()["seconds"] == 2.0


def test_a_reader_that_reads_is_not_behind_by_its_kernels_bookkeeping_one_that_stopped_is() -> None:
    """Behind haproxy on a busy engine a reader that read everything offered 91 KB of its
    once 101 KB window; while its right edge moves, such a shortfall is not counted. Once it
    stops (the edge stands still) all of it is, READING_NS after its last read."""
    meter = FlowMeter()
    bookkeeping = WINDOW // READING_SHORTFALL_SHARE
    start = streaming(unread=0, at_ns=T0)
    meter.note(start)
    # It read what came: acknowledged 10 KB more and offers a window 6 KB below its largest.
    reading = start.with_changes(
        observed_ns=T0 + STEP_NS, bytes_acked=start.bytes_acked + 10_000, peer_rwnd=WINDOW - 6000
    )
    meter.note(reading)
    assert meter.backlog(reading).window_shortfall == max(0, 6000 - bookkeeping)
    # It stops: its kernel acknowledges 4 KB more and the window shrinks by as much.
    stopped = reading.with_changes(
        observed_ns=reading.observed_ns + READING_NS + 1,
        bytes_acked=reading.bytes_acked + 4096,
        peer_rwnd=WINDOW - 6000 - 4096,
    )
    meter.note(stopped)
    assert meter.backlog(stopped).window_shortfall == 6000 + 4096
