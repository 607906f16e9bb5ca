"""Following streams under pressure (kvwatch.act.episode_runner), with its real collaborators
(hook server, engine hook, executor, recorder, joiner) and samples the test hands it as the
kernel's: a reader that falls behind gets its request paused, parked after park_seconds and
released when it catches up, each decision written once; observe mode holds nothing and says
so once; a held request's lease is renewed; a declined hold is asked again; a stall is cut
once, when it matures; a closed socket is forgotten at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvwatch.act.actions import Actions
from kvwatch.act.audit import AuditLog
from kvwatch.act.carry import Executor
from kvwatch.act.episode_runner import (
    BACKLOG_LOOK_NS,
    BEHIND_MIN_BYTES,
    HOLD_RETRY_SECONDS,
    EpisodeRunner,
)
from kvwatch.act.record import Recorder
from kvwatch.collect.gpu import GpuInventory
from kvwatch.collect.procfs import Procfs
from kvwatch.config.schema import PolicyConfig
from kvwatch.hook import CommandHandler, CommandOutcome, EngineHook
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.policy.decide import Decider
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.join import Joiner
from kvwatch.streams.relay import RelayIndex
from kvwatch.streams.states import StallJudgement, StallThresholds
from kvwatch.streams.timeline import Timelines
from kvwatch.streams.view import StreamView
from tests.act.stalled import StalledConnections
from tests.hookserver.conftest import engine_hook, run_async, running_server, wait_until

S = 1_000_000_000
RATE = 20_000  # the stream's output, bytes per second
WINDOW = 65_536
HOLDING = PolicyConfig(
    mode="enforce",
    grace_seconds=0,
    pause_seconds=1.0,
    release_seconds=0.5,
    park_seconds=0.3,
)


@dataclass
class RecordingEngine:
    """An engine's command handlers answering with the statuses the test sets, recording
    each command (name, request id, reason)."""

    statuses: dict[str, str] = field(
        default_factory=lambda: {
            "cancel": "cancelled",
            "pause": "paused",
            "park": "parked",
            "release": "released",
        }
    )
    commands: list[tuple[str, str, str]] = field(default_factory=list)

    def handler(self, name: str) -> CommandHandler:
        def handle(request_id: str, reason: str) -> CommandOutcome:
            self.commands.append((name, request_id, reason))
            freed = 3 if self.statuses[name] in ("cancelled", "parked") else 0
            return CommandOutcome(request_id, self.statuses[name], freed, freed * 16384)

        return handle

    def names(self, reason: str | None = None) -> list[str]:
        return [name for name, _, why in self.commands if reason in (None, why)]


class Kernel:
    """What a fresh look at a socket finds: the sample the test set (None: closed)."""

    def __init__(self) -> None:
        self.sockets: dict[int, SocketSample | None] = {}
        self.reads = 0

    async def read(self, key: int) -> SocketSample | None:
        self.reads += 1
        return self.sockets.get(key)


@dataclass
class Lab:
    runner: EpisodeRunner
    kernel: Kernel
    hooks: HookServer
    hook: EngineHook
    recorder: Recorder
    engine: RecordingEngine
    stall_lengths: list[float]

    def decisions(self) -> list[tuple[str, str, tuple[str, ...]]]:
        events = [e for e in self.recorder.events if e["kind"] == "decision"]
        return [(e["verdict"], e["reason"], tuple(e["actions"])) for e in events]

    async def announce(self, sample: SocketSample, request_id: str = "cmpl-1") -> None:
        ends = ((sample.local.ip, sample.local.port), (sample.remote.ip, sample.remote.port))
        self.hook.stream_opened(request_id, *ends, kv_blocks=4)
        await wait_until(lambda: self.hooks.live(request_id))


@contextlib.asynccontextmanager
async def lab(
    socket_path: str,
    policy: PolicyConfig = HOLDING,
    engine: RecordingEngine | None = None,
    features: tuple[str, ...] = ("pause", "park", "release"),
) -> AsyncIterator[Lab]:
    engine = engine or RecordingEngine()

    def handler(name: str) -> CommandHandler | None:
        return engine.handler(name) if name in features else None

    async with (
        running_server(socket_path) as (hooks, _),
        engine_hook(
            socket_path,
            engine.handler("cancel"),
            pause_handler=handler("pause"),
            park_handler=handler("park"),
            release_handler=handler("release"),
        ) as hook,
    ):
        await wait_until(lambda: bool(hooks.engines()))
        actions = Actions(hooks, "/proc", int(policy.lease_seconds * 1000))
        recorder = Recorder(AuditLog(None, echo=None), Timelines(16))
        joiner = Joiner(Procfs(), GpuInventory())
        thresholds = StallThresholds.of_policy(policy)

        def view_of(sample: SocketSample, now_ns: int, judgement: StallJudgement) -> StreamView:
            stream, relay = RelayIndex(()).behind(sample, hooks)
            return joiner.view(sample, stream, now_ns, thresholds, judgement, relay)

        kernel, lengths = Kernel(), list[float]()
        runner = EpisodeRunner(
            policy,
            Executor(actions, recorder, Decider(policy), joiner),
            recorder,
            recorder.timelines,
            kernel.read,
            view_of,
            lambda sample: hooks.find(sample.local, sample.remote) is not None,
            lengths.append,
        )
        try:
            yield Lab(runner, kernel, hooks, hook, recorder, engine, lengths)
        finally:
            runner.close()
            actions.close()


def streaming(key: int = 7, unread: int = 0, at_ns: int | None = None) -> SocketSample:
    """A healthy-looking socket of this process whose reader holds `unread` bytes: its window
    that much below the largest it advertised; nothing pending at the server."""
    now = time.monotonic_ns() if at_ns is None else at_ns
    return SocketSample(
        key=key, source="bpf", observed_ns=now, local=Endpoint("127.0.0.1", 8000),
        remote=Endpoint("127.0.0.1", 40000 + key), netns=1, inode=1, pid=os.getpid(),
        comm="python3", tcp_state=1, wmem_queued=0, sndbuf=87040, notsent_bytes=0,
        unacked_bytes=0, peer_rwnd=WINDOW - unread, srtt_us=100, snd_cwnd=10, retransmits=0,
        zero_window_probes=0, zero_window_episodes=0, zero_window_since_ns=0,
        zero_window_total_ns=0, last_zero_window_end_ns=0, sndbuf_full_episodes=0,
        sndbuf_full_since_ns=0, progress_ns=now, first_seen_ns=now - 10 * S,
        bytes_acked=1_000_000, peer_rwnd_max=WINDOW, rto_us=200_000, last_ack_ns=now,
    )  # fmt: skip


def metered(runner: EpisodeRunner, sample: SocketSample, rate: int = RATE) -> None:
    """Lets the runner's flow meter measure the stream at `rate` over the second before, its
    reader reading none of it: its kernel acknowledged `rate` bytes and its window shrank by
    as much (its right edge stood still)."""
    earlier = sample.with_changes(
        observed_ns=sample.observed_ns - S,
        bytes_acked=sample.bytes_acked - rate,
        peer_rwnd=min(WINDOW, sample.peer_rwnd + rate),
    )
    runner.meter.note(earlier)
    runner.meter.note(sample)


def behind(lab: Lab, unread: int) -> SocketSample:
    sample = streaming(unread=unread)
    metered(lab.runner, sample)
    lab.kernel.sockets[sample.key] = sample
    return sample


def test_a_reader_behind_is_paused_parked_and_released_once_it_catches_up(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with lab(socket_path) as it:
            sample = behind(it, unread=int(1.5 * RATE))  # 1.5 s behind
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            await wait_until(lambda: it.engine.names() == ["pause"])
            await wait_until(lambda: "park" in it.engine.names(), timeout_seconds=3)

            def held() -> bool:
                stream = it.hooks.find(sample.local, sample.remote)
                return stream is not None and stream.parked and stream.paused

            await wait_until(held)
            caught_up = streaming(unread=0)
            it.kernel.sockets[sample.key] = caught_up
            await wait_until(lambda: "release" in it.engine.names(), timeout_seconds=3)
            assert it.engine.names() == ["pause", "park", "release"]
            assert it.decisions() == [
                ("act", "reader_behind", ("pause",)),
                ("act", "reader_still_behind", ("park",)),
                ("act", "reader_caught_up", ("release",)),
            ]
            await wait_until(lambda: not len(it.runner.episodes))
            stream = it.hooks.find(sample.local, sample.remote)
            assert stream is not None and not (stream.paused or stream.parked)

    run_async(scenario())


def test_observe_mode_holds_nothing_and_says_each_hold_once(socket_path: str) -> None:
    observe = dataclasses.replace(HOLDING, mode="observe")

    async def scenario() -> None:
        async with lab(socket_path, observe) as it:
            sample = behind(it, unread=int(1.5 * RATE))
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            await wait_until(lambda: len(it.decisions()) == 2, timeout_seconds=3)
            await wait_until(lambda: it.kernel.reads >= 6)  # it goes on looking
            assert it.decisions() == [
                ("would_act", "reader_behind", ("pause",)),
                ("would_act", "reader_still_behind", ("park",)),
            ]
            assert it.engine.commands == []

    run_async(scenario())


def test_a_held_requests_lease_is_renewed_before_it_runs_out(socket_path: str) -> None:
    short_lease = dataclasses.replace(HOLDING, lease_seconds=1.0, park_seconds=60)

    async def scenario() -> None:
        async with lab(socket_path, short_lease) as it:
            sample = behind(it, unread=int(1.5 * RATE))
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            tally = it.runner.executor.actions.tally
            await wait_until(lambda: tally.renewals >= 2, timeout_seconds=3)
            assert it.engine.names("reader_behind") == ["pause"]
            assert len(it.engine.names("renew")) >= 2
            assert len(it.decisions()) == 1  # a renewal decides nothing

    run_async(scenario())


def test_a_declined_pause_is_asked_again(socket_path: str) -> None:
    engine = RecordingEngine()
    engine.statuses["pause"] = "declined"

    async def scenario() -> None:
        async with lab(socket_path, engine=engine) as it:
            sample = behind(it, unread=int(1.5 * RATE))
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            await wait_until(lambda: len(engine.names()) == 1)
            started = time.monotonic()
            await wait_until(lambda: len(engine.names()) == 2, timeout_seconds=3)
            assert time.monotonic() - started >= HOLD_RETRY_SECONDS * 0.8
            assert engine.names() == ["pause", "pause"]

    run_async(scenario())


def test_back_pressure_is_behind_where_the_rate_is_not_known_yet(socket_path: str) -> None:
    async def scenario() -> None:
        async with lab(socket_path) as it:
            sample = streaming().with_changes(
                zero_window_since_ns=time.monotonic_ns(), peer_rwnd=0, notsent_bytes=4096
            )
            it.kernel.sockets[sample.key] = sample
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())  # the meter has no rate for it
            await wait_until(lambda: it.engine.names() == ["pause"])

    run_async(scenario())


def test_a_slow_streams_reader_is_behind_only_past_the_backlogs_error(socket_path: str) -> None:
    """Seconds of a 3 KB/s stream's output are within what the backlog cannot tell from the
    receiver's bookkeeping: behind takes BEHIND_MIN_BYTES too (or a full buffer: a small
    one), and below half of it a held reader has caught up."""

    async def scenario() -> None:
        async with lab(socket_path) as it:
            rate = 3000
            within = streaming(key=11, unread=BEHIND_MIN_BYTES - 1024)  # 5 s of output
            metered(it.runner, within, rate)
            assert not it.runner.pressure(within).behind
            past = streaming(key=12, unread=BEHIND_MIN_BYTES + 1024)
            metered(it.runner, past, rate)
            assert it.runner.pressure(past).behind
            full = streaming(key=13, unread=4096).with_changes(peer_rwnd=0, notsent_bytes=8192)
            metered(it.runner, full, rate)
            assert it.runner.pressure(full).behind, "a small buffer, full"
            error = streaming(key=14, unread=BEHIND_MIN_BYTES // 2 - 1024)  # 2.3 s of output
            metered(it.runner, error, rate)
            assert it.runner.pressure(error).caught_up

    run_async(scenario())


def test_a_healthy_reader_is_not_followed(socket_path: str) -> None:
    async def scenario() -> None:
        async with lab(socket_path) as it:
            sample = behind(it, unread=int(0.2 * RATE))
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            assert len(it.runner.timers) == 0 and not len(it.runner.episodes)

    run_async(scenario())


def test_a_stall_is_cut_once_when_it_matures_and_a_closed_socket_is_forgotten(
    socket_path: str, stalled_connections: StalledConnections
) -> None:
    async def scenario() -> None:
        async with lab(socket_path, features=()) as it:
            sample = stalled_connections.sample(key=9, pid=os.getpid())
            it.kernel.sockets[sample.key] = sample
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            await wait_until(lambda: any(e["kind"] == "outcome" for e in it.recorder.events))
            it.runner.observe(sample, time.monotonic_ns())  # the same stall: done with it
            await asyncio.sleep(0.3)  # deliberate: room for a second cut, were there one
            assert it.engine.names() == ["cancel"]
            assert it.decisions() == [("act", "stalled", ("cancel",))]
            it.runner.gone(sample, time.monotonic_ns())
            assert not len(it.runner.episodes) and len(it.runner.timers) == 0
            assert len(it.stall_lengths) == 1

    run_async(scenario())


def test_the_next_look_at_a_held_stream_comes_within_the_backlog_poll(socket_path: str) -> None:
    async def scenario() -> None:
        async with lab(socket_path, dataclasses.replace(HOLDING, park_seconds=60)) as it:
            sample = behind(it, unread=int(1.5 * RATE))
            await it.announce(sample)
            it.runner.observe(sample, time.monotonic_ns())
            await wait_until(lambda: it.engine.names() == ["pause"])
            reads = it.kernel.reads
            started = time.monotonic()
            await wait_until(lambda: it.kernel.reads >= reads + 2)
            assert time.monotonic() - started < 4 * BACKLOG_LOOK_NS / S

    run_async(scenario())
