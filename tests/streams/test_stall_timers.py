"""The stall timers (kvwatch.streams.stall_timers) on hand-made samples, with a `read` that
returns what the test says the kernel shows now and a handler that records its calls: a stall
reaches the handler when it matures, not before and not by polling; one timer and one check
per socket however often it is observed; the handler hears of an episode until it says it is
done, and never after; a failing handler is tried again, at the next observation or after
RETRY_AFTER_ERROR_SECONDS; `forget`, an ended back-pressure, a closed socket and a reader that
keeps draining all end in no report. Stalls here mature in 0.2 s (a small `stall_seconds`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.stall_timers import RETRY_AFTER_ERROR_SECONDS, StallTimers, episode_of
from kvwatch.streams.states import StallJudgement, StallThresholds
from tests.hookserver.conftest import run_async, wait_until

MS = 1_000_000
# A reader guaranteed at 1 MB/s drains the peer's 1000-byte buffer in 1 ms: the peer's answer
# 5 ms into the stall proves it, so `stall_seconds` alone sets when a stall matures.
POLICY = StallThresholds(stall_seconds=0.2, min_reader_bytes_per_second=1_000_000)
KEY = 7


def pressed(since_ns: int, bytes_acked: int = 1000, key: int = KEY) -> SocketSample:
    """A socket whose peer closed its window at `since_ns` with 4 KB pending and answered a
    probe 5 ms later (alive, not reading); it is stalled from `since_ns` + 0.2 s on."""
    return SocketSample(
        key=key, source="bpf", observed_ns=since_ns, local=Endpoint("127.0.0.1", 8000),
        remote=Endpoint("127.0.0.1", 40000 + key), netns=1, inode=1, pid=10, comm="engine",
        tcp_state=1, wmem_queued=9000, sndbuf=87040, notsent_bytes=4096, unacked_bytes=0,
        peer_rwnd=0, srtt_us=100, snd_cwnd=10, retransmits=0, zero_window_probes=1,
        zero_window_episodes=1, zero_window_since_ns=since_ns, zero_window_total_ns=0,
        last_zero_window_end_ns=0, sndbuf_full_episodes=0, sndbuf_full_since_ns=0,
        progress_ns=since_ns, first_seen_ns=since_ns, bytes_acked=bytes_acked,
        peer_rwnd_max=1000, rto_us=200_000, last_ack_ns=since_ns + 5 * MS,
    )  # fmt: skip


def drained(sample: SocketSample, now_ns: int) -> SocketSample:
    """The same socket after its reader took everything: window open, nothing pending."""
    return sample.with_changes(
        observed_ns=now_ns,
        zero_window_since_ns=0,
        last_zero_window_end_ns=now_ns,
        peer_rwnd=65535,
        notsent_bytes=0,
        progress_ns=now_ns,
        bytes_acked=sample.bytes_acked + sample.pending_bytes,
    )


class Kernel:
    """What `read` finds: the newest sample of each socket (None: closed), and how often it
    was asked."""

    def __init__(self) -> None:
        self.sockets: dict[int, SocketSample | None] = {}
        self.reads = 0

    async def read(self, key: int) -> SocketSample | None:
        self.reads += 1
        return self.sockets.get(key)


class Handler:
    """Records each call (monotonic ns, sample, judgement); answers with `answers` in turn
    (an exception is raised), then None; waits for `release` when given one."""

    def __init__(
        self,
        answers: tuple[float | Exception | None, ...] = (),
        release: asyncio.Event | None = None,
    ) -> None:
        self.answers = list(answers)
        self.release = release
        self.calls: list[tuple[int, SocketSample, StallJudgement]] = []
        self.running = 0
        self.most_running = 0

    async def __call__(self, sample: SocketSample, judgement: StallJudgement) -> float | None:
        self.calls.append((time.monotonic_ns(), sample, judgement))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.release is not None:
                await self.release.wait()
            answer = self.answers.pop(0) if self.answers else None
            if isinstance(answer, Exception):
                raise answer
            return answer
        finally:
            self.running -= 1


def test_a_stall_reaches_the_handler_when_it_matures_not_before_and_not_by_polling() -> None:
    kernel, handler = Kernel(), Handler()
    policy = StallThresholds(stall_seconds=0.5, min_reader_bytes_per_second=1_000_000)

    async def scenario() -> None:
        start = time.monotonic_ns()
        sample = pressed(start)
        kernel.sockets[KEY] = sample
        timers = StallTimers(policy, kernel.read, handler)
        timers.observe(sample)
        assert len(timers) == 1
        await asyncio.sleep(0.1)  # deliberate: a window in which nothing may happen
        assert not handler.calls and kernel.reads == 0  # asleep until the stall can mature
        await wait_until(lambda: bool(handler.calls), timeout_seconds=2)
        called_ns, seen, judgement = handler.calls[0]
        assert start + policy.stall_ns <= called_ns < start + policy.stall_ns + 250 * MS
        assert seen == sample and judgement.stalled and judgement.since_ns == start
        assert kernel.reads <= 2  # a timer at the moment, not a poll
        timers.close()

    run_async(scenario())


def test_the_handler_hears_of_a_stall_until_it_says_done_and_never_after() -> None:
    kernel, handler = Kernel(), Handler(answers=(0.05, 0.05))  # then None: done

    async def scenario() -> None:
        sample = pressed(time.monotonic_ns() - 1_000 * MS)  # stalled already
        kernel.sockets[KEY] = sample
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(sample)
        await wait_until(lambda: len(handler.calls) == 3, timeout_seconds=2)
        for _ in range(20):  # edge events and scans of the same stall episode
            timers.observe(sample)
            await asyncio.sleep(0.01)  # deliberate: observations spread over 0.2 s
        await asyncio.sleep(0.2)  # deliberate: room for a fourth call, were there one
        assert len(handler.calls) == 3 and len(timers) == 0
        again = pressed(time.monotonic_ns(), bytes_acked=2000)  # progress, then a new stall
        kernel.sockets[KEY] = again
        timers.observe(again)
        await wait_until(lambda: len(handler.calls) == 4, timeout_seconds=2)
        assert episode_of(handler.calls[3][1]) == 2000
        timers.close()

    run_async(scenario())


def test_one_check_at_a_time_however_often_a_socket_is_observed() -> None:
    release = asyncio.Event()
    kernel, handler = Kernel(), Handler(release=release)

    async def scenario() -> None:
        sample = pressed(time.monotonic_ns() - 1_000 * MS)
        kernel.sockets[KEY] = sample
        timers = StallTimers(POLICY, kernel.read, handler)
        for _ in range(50):
            timers.observe(sample)
        assert len(timers) == 1
        await wait_until(lambda: bool(handler.calls), timeout_seconds=2)
        for _ in range(50):  # while the handler works on it
            timers.observe(sample)
            await asyncio.sleep(0)  # lets the handler's task run between observations
        assert len(timers) == 0 and len(handler.calls) == 1
        release.set()
        await asyncio.sleep(0.1)  # deliberate: room for a second check, were there one
        assert len(handler.calls) == 1 and handler.most_running == 1 and kernel.reads == 1
        timers.close()

    run_async(scenario())


def test_a_failed_handler_is_tried_again_at_the_next_observation_without_waiting() -> None:
    kernel, handler = Kernel(), Handler(answers=(RuntimeError("the engine hook hiccupped"),))

    async def scenario() -> None:
        sample = pressed(time.monotonic_ns() - 1_000 * MS)
        kernel.sockets[KEY] = sample
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(sample)
        await wait_until(lambda: bool(handler.calls) and len(timers) == 1, timeout_seconds=2)
        timers.observe(sample)  # the episode is not done: a fresh look retries it now
        await wait_until(lambda: len(handler.calls) == 2, timeout_seconds=2)
        gap_ns = handler.calls[1][0] - handler.calls[0][0]
        assert gap_ns < RETRY_AFTER_ERROR_SECONDS * 1e9 / 2
        await asyncio.sleep(0.2)  # deliberate: room for a third call, were there one
        assert len(handler.calls) == 2  # the retry said done
        timers.close()

    run_async(scenario())


def test_a_handler_that_keeps_failing_is_retried_once_per_delay_not_in_a_loop() -> None:
    failures = tuple(RuntimeError(f"failure {n}") for n in range(10))
    kernel, handler = Kernel(), Handler(answers=failures)

    async def scenario() -> None:
        sample = pressed(time.monotonic_ns() - 1_000 * MS)
        kernel.sockets[KEY] = sample
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(sample)
        # deliberate: time for exactly one retry after the delay (a loop would make many)
        await asyncio.sleep(RETRY_AFTER_ERROR_SECONDS * 1.5)
        assert len(handler.calls) == 2
        gap_ns = handler.calls[1][0] - handler.calls[0][0]
        assert gap_ns >= RETRY_AFTER_ERROR_SECONDS * 1e9 * 0.95
        timers.close()

    run_async(scenario())


def test_forget_cancels_the_timer() -> None:
    kernel, handler = Kernel(), Handler()

    async def scenario() -> None:
        sample, other = pressed(time.monotonic_ns()), pressed(time.monotonic_ns(), key=KEY + 1)
        kernel.sockets = {KEY: sample, KEY + 1: other}
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(sample)
        timers.observe(other)
        timers.forget(KEY)  # the socket closed
        assert len(timers) == 1
        await wait_until(lambda: bool(handler.calls), timeout_seconds=2)  # both were due now
        await asyncio.sleep(0.05)  # deliberate: room for the forgotten one, were it called
        assert [call[1].key for call in handler.calls] == [KEY + 1]
        timers.close()

    run_async(scenario())


@pytest.mark.parametrize("ending", ["window_reopened", "socket_closed"])
def test_a_socket_whose_back_pressure_ends_before_the_stall_matures_is_not_reported(
    ending: str,
) -> None:
    kernel, handler = Kernel(), Handler()

    async def scenario() -> None:
        sample = pressed(time.monotonic_ns())
        kernel.sockets[KEY] = sample
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(sample)
        after = drained(sample, time.monotonic_ns())
        kernel.sockets[KEY] = after if ending == "window_reopened" else None
        await wait_until(lambda: kernel.reads == 1, timeout_seconds=2)  # when it was due
        await asyncio.sleep(POLICY.stall_seconds)  # deliberate: room for a later look or call
        assert kernel.reads == 1 and not handler.calls and len(timers) == 0
        timers.close()

    run_async(scenario())


def test_an_observation_without_back_pressure_drops_the_timer() -> None:
    kernel, handler = Kernel(), Handler()

    async def scenario() -> None:
        sample = pressed(time.monotonic_ns())
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(sample)
        timers.observe(drained(sample, time.monotonic_ns()))  # an edge event: window open
        assert len(timers) == 0
        await asyncio.sleep(POLICY.stall_seconds + 0.15)  # deliberate: past when it was due
        assert kernel.reads == 0 and not handler.calls
        timers.close()

    run_async(scenario())


def test_a_reader_that_keeps_draining_is_looked_at_but_never_reported() -> None:
    """Its window stays closed, but each look finds the ACK point moved since the last."""
    handler = Handler()
    reads: list[int] = []

    async def read(key: int) -> SocketSample:
        now_ns = time.monotonic_ns()
        reads.append(now_ns)
        return pressed(now_ns, bytes_acked=1000 + 100 * len(reads), key=key).with_changes(
            zero_window_since_ns=now_ns - 150 * MS  # the window stays shut: only ACKs move
        )

    async def scenario() -> None:
        timers = StallTimers(POLICY, read, handler)
        timers.observe(pressed(time.monotonic_ns()))
        await asyncio.sleep(4 * POLICY.stall_seconds)  # deliberate: counts looks over 0.8 s
        assert 2 <= len(reads) <= 5  # looked at once per stall_seconds, while it lasts
        looks = len(reads)
        await wait_until(lambda: len(reads) > looks, timeout_seconds=2)  # and still watched
        assert not handler.calls
        timers.close()

    run_async(scenario())


def test_an_episode_is_named_by_the_acknowledged_bytes_whichever_view_shows_it() -> None:
    bpf = pressed(1_000 * MS, bytes_acked=123_456)
    diag = bpf.with_changes(key=0xC00C1E, source="inet_diag", progress_ns=0, peer_rwnd=-1)
    assert episode_of(bpf) == episode_of(diag) == 123_456
    assert episode_of(bpf.with_changes(bytes_acked=123_457)) != episode_of(bpf)


def test_a_new_stall_that_begins_while_the_last_one_is_handled_is_not_lost() -> None:
    kernel, release = Kernel(), asyncio.Event()
    handler = Handler(release=release)

    async def scenario() -> None:
        start = time.monotonic_ns()
        first = pressed(start)
        kernel.sockets[KEY] = first
        timers = StallTimers(POLICY, kernel.read, handler)
        timers.observe(first)
        await wait_until(lambda: bool(handler.calls), timeout_seconds=2)
        # While the first stall is being handled, the reader takes a little and stalls again.
        second = pressed(time.monotonic_ns(), bytes_acked=first.bytes_acked + 500)
        kernel.sockets[KEY] = second
        timers.observe(second)
        release.set()
        await wait_until(lambda: len(handler.calls) == 2, timeout_seconds=2)
        assert episode_of(handler.calls[1][1]) == episode_of(second)
        timers.close()

    run_async(scenario())


def test_with_park_seconds_the_pressure_handler_comes_first_once_then_the_stall() -> None:
    kernel, on_pressure, on_stalled = Kernel(), Handler(answers=(0.05,)), Handler()
    policy = StallThresholds(stall_seconds=0.5, min_reader_bytes_per_second=1_000_000)

    async def scenario() -> None:
        start = time.monotonic_ns()
        sample = pressed(start)
        kernel.sockets[KEY] = sample
        timers = StallTimers(
            policy, kernel.read, on_stalled, on_pressure=on_pressure, park_seconds=0.2
        )
        timers.observe(sample)
        await wait_until(lambda: len(on_pressure.calls) == 2, timeout_seconds=2)
        first_ns, _, judgement = on_pressure.calls[0]
        assert start + 200 * MS <= first_ns < start + 400 * MS  # at park_seconds, not later
        assert not judgement.stalled and not on_stalled.calls
        assert on_pressure.calls[1][0] - first_ns >= 50 * MS  # its retry, as it asked
        for _ in range(5):  # observations of the same episode: no third pressure call
            timers.observe(sample)
        await wait_until(lambda: bool(on_stalled.calls), timeout_seconds=2)
        assert on_stalled.calls[0][0] >= start + policy.stall_ns
        assert len(on_pressure.calls) == 2
        again = pressed(time.monotonic_ns(), bytes_acked=2000)  # progress: a new episode
        kernel.sockets[KEY] = again
        timers.observe(again)
        await wait_until(lambda: len(on_pressure.calls) == 3, timeout_seconds=2)
        timers.close()

    run_async(scenario())
