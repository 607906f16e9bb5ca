"""The decide and act steps as the episode runner takes them for a stalled socket
(kvwatch.act.episode_runner), with their real collaborators, for tests."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from kvwatch.act.actions import Actions
from kvwatch.act.audit import AuditLog
from kvwatch.act.carry import Executor
from kvwatch.act.record import Recorder
from kvwatch.config.schema import PolicyConfig
from kvwatch.hookserver.registry import EngineStream
from kvwatch.policy.decide import Decider
from kvwatch.policy.rules import CancelBudget
from kvwatch.sockets import SocketSample
from kvwatch.streams.episodes import Episodes
from kvwatch.streams.join import Joiner
from kvwatch.streams.relay import RelayLink
from kvwatch.streams.states import StallJudgement, StallThresholds
from kvwatch.streams.timeline import Timelines

Behind = Callable[[SocketSample], tuple[EngineStream | None, RelayLink | None]]


class Pipeline:
    """Joins a stalled socket (`behind` finds its engine stream), lets the policy decide and
    the executor carry the decision out, in the socket's stall episode."""

    def __init__(
        self,
        policy: PolicyConfig,
        behind: Behind,
        joiner: Joiner,
        actions: Actions,
        audit: AuditLog,
        timelines: Timelines,
    ) -> None:
        self.stall_thresholds = StallThresholds.of_policy(policy)
        self.behind = behind
        self.joiner = joiner
        self.actions = actions
        self.timelines = timelines
        self.recorder = Recorder(audit, timelines)
        self.executor = Executor(actions, self.recorder, Decider(policy), joiner)
        self.episodes = Episodes()

    @property
    def decisions(self) -> Counter[tuple[str, str]]:
        return self.recorder.decisions

    @property
    def events(self) -> deque[dict[str, Any]]:
        return self.recorder.events

    @property
    def budget(self) -> CancelBudget:
        return self.executor.budget

    def failure_of(self, sample: SocketSample) -> dict[str, Any] | None:
        episode = self.episodes.get(sample)
        return episode.failed(sample) if episode is not None else None

    async def on_stalled(self, sample: SocketSample, judgement: StallJudgement) -> float | None:
        engine, relay = self.behind(sample)
        now_ns = time.monotonic_ns()
        view = self.joiner.view(sample, engine, now_ns, self.stall_thresholds, judgement, relay)
        stall = self.episodes.begin(sample, now_ns).stall_for(sample)
        return await self.executor.on_stalled(stall, view)
