"""Following each stream under pressure, one episode at a time (kvwatch.streams.episodes): when
to look at a socket, and what a look does — the stall's cut (kvwatch.act.carry) and the
reader-paced hold (pause, park or detach, release; kvwatch.policy.hold).

A socket is followed from the moment its stall conditions begin (the judge is on its way) or,
for a socket that carries an engine's stream, its reader falls behind by half the pause
bound, until nothing about it can change any more: its reader caught up, nothing holds its
request and no stall condition holds, or the socket is gone. `gone` forgets everything kept
about a socket in one call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvwatch.act.carry import Executor
from kvwatch.act.record import Recorder
from kvwatch.collect.collectors import ConnectionKey, connection_key
from kvwatch.collect.window_probe import SocketGoneError
from kvwatch.config.schema import PolicyConfig
from kvwatch.errors import PrivilegeError
from kvwatch.hookserver.registry import EngineStream
from kvwatch.policy.decide import Decider, retry_after
from kvwatch.policy.hold import NOT_NEWS, HoldSituation
from kvwatch.sockets import SocketSample
from kvwatch.streams.backlog import Backlog, FlowMeter
from kvwatch.streams.episodes import Episode, Episodes, HeldAs, Hold, Stall, Unfinished
from kvwatch.streams.look_timers import LookTimers
from kvwatch.streams.states import StallJudgement, StallThresholds, judge
from kvwatch.streams.timeline import Timelines, connection_id
from kvwatch.streams.view import StreamView

log = logging.getLogger(__name__)

NS = 1_000_000_000
# A stream whose reader is behind, or held, is looked at this often: a reader that drains
# its backlog is released within it.
BACKLOG_LOOK_NS = 250_000_000
# A stream this far to the pause bound is followed (its backlog may be growing).
WATCH_FRACTION = 0.5
# Where a stream's rate is not known yet, its reader has caught up once the backlog is this
# small (and no back-pressure holds).
CAUGHT_UP_BYTES = 4096
# The backlog's error (the receiver's bookkeeping, window rounding) is several KB, seconds of
# a slow stream's output: readers that read everything of a 3-4 KB/s stream behind haproxy
# on a busy engine showed 6.5-9.6 KB. So a reader is behind only with BEHIND_MIN_BYTES unread
# too, or with its buffer full (zero window, or the send buffer full: a small buffer), and
# has caught up below half of it: a reader that stopped passes it within seconds (its window
# shrinks by what is sent), and one that read everything is not held on the error.
BEHIND_MIN_BYTES = 16 * 1024
# A hold action that did not take effect is asked again after this long, this many times.
HOLD_RETRY_SECONDS = 1.0
HOLD_TRIES = 5
# The hold (a pause's or a park's) the engine keeps is renewed this far into its lease.
RENEW_FRACTION = 1 / 3
HELD_BY_STATUS: dict[str, HeldAs] = {"paused": "paused", "parked": "parked", "detached": "detached"}

SampleReader = Callable[[int], Awaitable[SocketSample | None]]
ViewOf = Callable[[SocketSample, int, StallJudgement], StreamView]


@dataclass(frozen=True)
class Pressure:
    """How a socket's reader stands against the hold's bounds: `behind` (the pause bound),
    `caught_up` (below the release bound), `near` (half way to the pause bound)."""

    backlog: Backlog
    behind: bool
    caught_up: bool
    near: bool


def held_as(engine: EngineStream | None) -> HeldAs:
    """What the engine says it does with the request: the registry's truth."""
    if engine is None:
        return ""
    if engine.parked:
        return "parked"
    if engine.detached:
        return "detached"
    return "paused" if engine.paused else ""


class EpisodeRunner:
    """Owns the episodes, the look timers and the flow meter; owned by the event loop.
    `read` is a fresh look at one socket through the collector's door, `view_of` the join
    of a sample into a stream view, `carries_stream` whether a socket may carry an engine's
    stream (an engine announced it, or a proxy relays into it), `on_stall_ended` what a
    stall's length goes to (the duration histogram)."""

    def __init__(
        self,
        policy: PolicyConfig,
        executor: Executor,
        recorder: Recorder,
        timelines: Timelines,
        read: SampleReader,
        view_of: ViewOf,
        carries_stream: Callable[[SocketSample], bool],
        on_stall_ended: Callable[[float], None],
    ) -> None:
        self.policy = policy
        self.thresholds: StallThresholds = StallThresholds.of_policy(policy)
        self.executor = executor
        self.decider: Decider = executor.decider
        self.recorder = recorder
        self.timelines = timelines
        self.read = read
        self.view_of = view_of
        self.carries_stream = carries_stream
        self.on_stall_ended = on_stall_ended
        self.episodes = Episodes()
        self.meter = FlowMeter()
        self.timers = LookTimers(self._look_at)
        self._zero_window_started: dict[int, int] = {}
        self._probes_refused = False

    # -- what the daemon tells it ----------------------------------------------------------

    def observe(self, sample: SocketSample, now_ns: int) -> None:
        """A fresh sample of a socket (an edge event or a scan): follow it, look at it when
        it is due, or stop following it."""
        carries = self.carries_stream(sample)
        episode = self.episodes.get(sample)
        if episode is None and not carries and not (sample.zero_window or sample.sndbuf_full):
            return  # no stall begins without back-pressure, and no stream is behind on it
        if carries:
            self.meter.note(sample, held=episode is not None and _holding(episode.hold))
        judgement = judge(sample, now_ns, self.thresholds)
        if episode is not None:
            self._measure_lapse(episode, judgement, now_ns)
        due = self._due_ns(sample, judgement, episode, carries, now_ns)
        if due is None:
            self.timers.forget(sample.key)
        else:
            self.timers.arm(sample.key, due)

    def zero_window(self, key: int, started: bool, ts_ns: int) -> float | None:
        """A zero window began or ended on `key`; returns the length of one that ended."""
        if started:
            self._zero_window_started[key] = ts_ns
            return None
        began = self._zero_window_started.pop(key, None)
        return (ts_ns - began) / NS if began is not None else None

    def left(self, present: set[ConnectionKey], now_ns: int) -> None:
        """The connections of a full look at the table: an episode whose connection is not
        among them ended (its socket left the table)."""
        if len(self.episodes):
            for connection in self.episodes.connections() - present:
                self._end(connection, now_ns)

    def gone(self, sample: SocketSample, now_ns: int) -> None:
        """The socket closed: the one place where all that is kept about it ends (its
        keepalive probes ended with it)."""
        self.timers.forget(sample.key)
        self.meter.forget(sample.key)
        self._zero_window_started.pop(sample.key, None)
        self.executor.actions.checked.forget(sample.key)
        self.executor.actions.worker.forget_probing(sample.key)
        self._end(connection_key(sample), now_ns)

    def stalled_connections(self) -> int:
        return sum(1 for e in self.episodes.open_episodes() if e.stall and e.stall.since_ns)

    def failed(self, sample: SocketSample) -> dict[str, object] | None:
        episode = self.episodes.get(sample)
        return episode.failed(sample) if episode is not None else None

    def backlog(self, sample: SocketSample) -> Backlog:
        return self.meter.backlog(sample)

    def close(self) -> None:
        self.timers.close()

    # -- when to look ------------------------------------------------------------------------

    def pressure(self, sample: SocketSample) -> Pressure:
        """The socket's backlog against the hold's bounds. Where the stream's rate is not
        known yet (a socket first seen under back-pressure, after a restart), back-pressure
        itself is behind."""
        backlog = self.meter.backlog(sample)
        seconds = backlog.seconds
        pressed = sample.zero_window or sample.sndbuf_full
        if seconds is None:
            caught_up = not pressed and backlog.bytes < CAUGHT_UP_BYTES
            return Pressure(backlog, pressed, caught_up, pressed)
        within_error = backlog.bytes < BEHIND_MIN_BYTES // 2 and not pressed
        return Pressure(
            backlog,
            behind=seconds >= self.policy.pause_seconds
            and (backlog.bytes >= BEHIND_MIN_BYTES or pressed),
            caught_up=seconds < self.policy.release_seconds or within_error,
            near=seconds >= self.policy.pause_seconds * WATCH_FRACTION,
        )

    def _due_ns(
        self,
        sample: SocketSample,
        judgement: StallJudgement,
        episode: Episode | None,
        carries: bool,
        now_ns: int,
    ) -> int | None:
        near = carries and self.pressure(sample).near
        if episode is None:
            if judgement.on_the_way or near:
                return now_ns
            return None
        return self._next_ns(episode, sample, judgement, carries, now_ns)

    def _next_ns(
        self,
        episode: Episode,
        sample: SocketSample,
        judgement: StallJudgement,
        carries: bool,
        now_ns: int,
    ) -> int | None:
        """The next look at a followed socket: when the judge's verdict can change, a hold
        milestone (a retry, a renewal, the park), or the next look at a backlog."""
        candidates: list[int] = []
        stall = episode.stall
        if judgement.on_the_way and not episode.stall_done(sample):
            candidates.append(judgement.recheck_ns or now_ns)
            if stall is not None and stall.retry_ns:
                candidates.append(stall.retry_ns)
        hold = episode.hold
        if carries and (_holding(hold) or self.pressure(sample).near or hold.behind_since_ns):
            candidates.append(now_ns + BACKLOG_LOOK_NS)
        candidates += [t for t in (hold.retry_ns, hold.renew_ns) if t]
        park_ns = self._park_due_ns(hold)
        if carries and park_ns > now_ns:  # a due park already past is the backlog look's
            candidates.append(park_ns)
        return max(min(candidates), now_ns) if candidates else None

    def _park_due_ns(self, hold: Hold) -> int:
        """When the hold rule's park (or detach) falls due: `park_seconds` after the pause
        took effect, or after the reader fell behind where nothing paused it (0: none due),
        so that it comes then rather than at the next backlog look, up to BACKLOG_LOOK_NS
        later."""
        if self.policy.park == "off" or hold.held in ("parked", "detached"):
            return 0
        if hold.decided & {"park", "detach"}:
            return 0
        start = hold.held_since_ns if hold.held else hold.behind_since_ns
        return start + int(self.policy.park_seconds * NS) if start else 0

    # -- a look --------------------------------------------------------------------------------

    async def _look_at(self, key: int) -> int | None:
        sample = await self.read(key)
        if sample is None:
            return None
        now_ns = time.monotonic_ns()
        carries = self.carries_stream(sample)
        episode = self.episodes.get(sample)
        if carries:
            self.meter.note(sample, held=episode is not None and _holding(episode.hold))
        judgement = judge(sample, now_ns, self.thresholds)
        pressure = self.pressure(sample)
        if episode is None:
            if not (judgement.on_the_way or (carries and pressure.behind)):
                return now_ns + BACKLOG_LOOK_NS if carries and pressure.near else None
            episode = self.episodes.begin(sample, now_ns)
        view = dataclasses.replace(
            self.view_of(sample, now_ns, judgement), backlog=pressure.backlog
        )
        await self._stall_part(episode, sample, judgement, view, now_ns)
        if carries:
            await self._hold_part(episode, view, pressure, now_ns)
        if self._over(episode, judgement, pressure, carries):
            await self.executor.actions.worker.stop_probing(sample.key)
            self._end(episode.connection, now_ns)
            return None
        return self._next_ns(episode, sample, judgement, carries, time.monotonic_ns())

    def _over(
        self, episode: Episode, judgement: StallJudgement, pressure: Pressure, carries: bool
    ) -> bool:
        """Nothing about the socket can change without a new observation: no stall condition
        holds, nothing holds its request, and its reader has caught up (or it carries no
        stream)."""
        if judgement.on_the_way or _holding(episode.hold):
            return False
        return not carries or pressure.caught_up

    async def _stall_part(
        self,
        episode: Episode,
        sample: SocketSample,
        judgement: StallJudgement,
        view: StreamView,
        now_ns: int,
    ) -> None:
        """The cut: a stall the judge calls stalled goes to the executor, once per stall
        (until it says it is done with it); a stall whose conditions lapsed is measured."""
        self._measure_lapse(episode, judgement, now_ns)
        if not judgement.stalled:
            return
        stall = episode.stall_for(sample)
        if stall.done or (stall.retry_ns and now_ns < stall.retry_ns):
            return
        if not stall.since_ns:
            stall.since_ns = judgement.since_ns
            self._note_stalled(sample, judgement, now_ns)
        retry = await self.executor.on_stalled(stall, view)
        stall.retry_ns = time.monotonic_ns() + int(retry * NS) if retry is not None else 0
        stall.done = retry is None

    async def _hold_part(
        self, episode: Episode, view: StreamView, pressure: Pressure, now_ns: int
    ) -> None:
        """The hold: pause, park or detach a stream whose reader is behind, release one whose
        reader caught up, renew the lease of a held one (kvwatch.policy.hold)."""
        hold = episode.hold
        self._sync_held(hold, held_as(view.engine), now_ns)
        await self._probe_while_held(hold, view)
        if pressure.behind and not hold.behind_since_ns:
            hold.behind_since_ns = now_ns
        elif not pressure.behind:
            hold.behind_since_ns = 0
        if hold.retry_ns and now_ns < hold.retry_ns:
            return
        hold.retry_ns = 0
        decision = self.decider.decide_hold(view, self._situation(hold, pressure, now_ns))
        if decision.reason in NOT_NEWS:
            await self._renew(hold, view, now_ns)
            return
        ref, evidence = self.recorder.decision(view, decision, hold, None)
        if decision.verdict == "skip":
            delay = retry_after(decision)
            hold.retry_ns = now_ns + int((delay or HOLD_RETRY_SECONDS) * NS)
            return
        action = decision.actions[0]
        if action != "release":
            hold.decided.add(action)
        if decision.verdict != "act":
            return
        unfinished = Unfinished(decision.reason, ref, evidence, decision.actions)
        await self._carry_hold(hold, view, action, unfinished, now_ns)

    async def _carry_hold(
        self, hold: Hold, view: StreamView, action: str, unfinished: Unfinished, now_ns: int
    ) -> None:
        tries = hold.tries[action] = hold.tries.get(action, 0) + 1
        unfinished.tries = tries - 1
        result = await self.executor.hold(view, unfinished)
        status = result["status"]
        if status in HELD_BY_STATUS:
            self._sync_held(hold, HELD_BY_STATUS[status], time.monotonic_ns())
            hold.renew_ns = now_ns + int(self.policy.lease_seconds * RENEW_FRACTION * NS)
        elif status in ("released", "not_held"):
            self._sync_held(hold, "", time.monotonic_ns())
        elif tries < HOLD_TRIES:
            hold.decided.discard(action)
            hold.retry_ns = now_ns + int(HOLD_RETRY_SECONDS * NS)

    async def _probe_while_held(self, hold: Hold, view: StreamView) -> None:
        """A held stream's socket probes its reader's window each second, so a reader that
        drains its backlog is seen even where its kernel sends no window update
        (kvwatch.collect.window_probe); probing ends with the hold."""
        worker, key = self.executor.actions.worker, view.sample.key
        if not _holding(hold):
            await worker.stop_probing(key)
            return
        if worker.probing(key) or self._probes_refused or not view.sample.inode:
            return
        try:
            await worker.start_probing(view.sample, view.socket_pid)
        except SocketGoneError:
            return
        except PrivilegeError as exc:
            self._probes_refused = True
            log.warning(
                "%s: a held stream whose reader drains less than half its window is seen only "
                'once more data flows (docs/agent.md, "Pause, park, release")',
                exc,
            )
            return
        self.executor.actions.tally.window_probes += 1

    async def _renew(self, hold: Hold, view: StreamView, now_ns: int) -> None:
        """Renews the engine's lease on a paused or parked request before it runs out (the
        pause command again; no decision: nothing changes for the stream)."""
        engine = view.engine
        if not (_holding(hold) and hold.renew_ns and now_ns >= hold.renew_ns):
            return
        if engine is None or not engine.can_pause:
            return
        hold.renew_ns = now_ns + int(self.policy.lease_seconds * RENEW_FRACTION * NS)
        await self.executor.actions.renew(engine, self._lease_ms)

    @property
    def _lease_ms(self) -> int:
        return int(self.policy.lease_seconds * 1000)

    def _situation(self, hold: Hold, pressure: Pressure, now_ns: int) -> HoldSituation:
        def since(start_ns: int) -> float:
            return (now_ns - start_ns) / NS if start_ns else 0.0

        return HoldSituation(
            behind=pressure.behind,
            caught_up=pressure.caught_up,
            backlog_seconds=pressure.backlog.seconds,
            behind_seconds=since(hold.behind_since_ns),
            held=hold.held,
            held_seconds=since(hold.held_since_ns),
            decided=frozenset(hold.decided),
        )

    @staticmethod
    def _sync_held(hold: Hold, held: HeldAs, now_ns: int) -> None:
        """What the engine says now: a hold that began is dated; one that ended clears what
        the episode decided of it, so a reader that falls behind again is held again."""
        if held == hold.held:
            return
        if held and not hold.held:
            hold.held_since_ns = now_ns
        elif not held:
            hold.held_since_ns = hold.renew_ns = 0
            hold.decided.clear()
            hold.logged = None
        hold.held = held

    # -- ends ------------------------------------------------------------------------------------

    def _note_stalled(self, sample: SocketSample, judgement: StallJudgement, now_ns: int) -> None:
        """Dated when the look judged it, as the decision it leads to is (ties keep order)."""
        timeline = self.timelines.of(connection_id(sample.local, sample.remote))
        if not any(e["event"] == "stalled" for e in timeline.entries):
            timeline.add(judgement.since_ns, "stall_conditions_began")
            timeline.add(
                now_ns,
                "stalled",
                required_seconds=round(judgement.required_ns / NS, 3),
                evidence=judgement.evidence(self.thresholds),
            )

    def _measure_lapse(self, episode: Episode, judgement: StallJudgement, now_ns: int) -> None:
        """A stall whose conditions lapsed (or began anew since) is over: it is measured."""
        stall = episode.stall
        if stall is not None and stall.since_ns and judgement.since_ns != stall.since_ns:
            self._stall_ended(stall, now_ns)

    def _stall_ended(self, stall: Stall, now_ns: int) -> None:
        """The stall is over (progress, lapsed conditions, or the socket gone): its length
        goes to the duration histogram."""
        if stall.since_ns:
            self.on_stall_ended(max(0.0, (now_ns - stall.since_ns) / NS))
            stall.since_ns = 0

    def _end(self, connection: ConnectionKey, now_ns: int) -> None:
        episode = self.episodes.end(connection)
        if episode is not None and episode.stall is not None:
            self._stall_ended(episode.stall, now_ns)


def _holding(hold: Hold) -> bool:
    """The engine holds the request (paused or parked): it waits for a release."""
    return hold.held in ("paused", "parked")
