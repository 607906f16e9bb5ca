"""From a stalled socket to a decision, its evidence, the audit line and the action."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from kvwatch.audit import AuditLog
from kvwatch.config import PolicyConfig
from kvwatch.daemon.actions import Actions
from kvwatch.daemon.hook_server import HookServer
from kvwatch.daemon.join import Joiner, StreamView
from kvwatch.daemon.timeline import Timelines, connection_id
from kvwatch.policy import CancelBudget, Candidate, Decision, decide
from kvwatch.sockets import SocketSample
from kvwatch.states import StatePolicy, stall_since_ns
from kvwatch.views import socket_json

RECHECK_SECONDS = 1.0
# Reasons that can change while the stall lasts: look again later instead of giving up.
TRANSIENT_REASONS = {
    "in_grace",
    "budget_exhausted",
    "unknown_kv",
    "below_min_kv",
    "no_action_possible",
}
EVENTS_KEPT = 2000


def evidence_of(view: StreamView, now_ns: int, policy: StatePolicy) -> dict[str, Any]:
    """What the decision was based on, for the audit log and `explain`: the socket as the
    `sockets` contract spells it, plus how long it has been stalled."""
    sample = view.sample
    evidence = socket_json(sample, now_ns, policy)
    evidence["stalled_seconds"] = round((now_ns - stall_since_ns(sample)) / 1e9, 3)
    if view.engine is not None:
        evidence.update(
            kv_blocks=view.engine.kv_blocks,
            kv_bytes=view.engine.kv_bytes,
            engine=view.engine.engine,
            engine_pid=view.engine.engine_pid,
        )
    if view.process is not None:
        evidence.update(cgroup=view.process.cgroup_path, pod_uid=view.process.pod_uid)
    if view.gpus:
        evidence["gpu"] = [g._asdict() for g in view.gpus]
    return evidence


def candidate_of(view: StreamView, now_ns: int) -> Candidate:
    sample, engine, process = view.sample, view.engine, view.process
    since = stall_since_ns(sample)
    return Candidate(
        request_id=engine.request_id if engine is not None else None,
        state=view.state,
        stalled_seconds=(now_ns - since) / 1e9 if since else 0.0,
        kv_bytes=view.kv_bytes,
        age_seconds=(now_ns - view.opened_ns) / 1e9,
        local_port=sample.local.port,
        comm=process.comm if process is not None else sample.comm,
        cgroup_path=process.cgroup_path if process is not None else "",
        container_id=process.container_id if process is not None else "",
        pod_uid=process.pod_uid if process is not None else "",
        has_engine_hook=engine is not None,
    )


class Decider:
    """Decides on stalled sockets and carries the decisions out. Owned by the event loop.

    Invariant: a decision is written to the audit log (and the event list) when its verdict
    or reason differs from the last one for that socket, so a long stall that stays denied
    is one line, not one a second."""

    def __init__(
        self,
        policy: PolicyConfig,
        hooks: HookServer,
        joiner: Joiner,
        actions: Actions,
        audit: AuditLog,
        timelines: Timelines,
    ) -> None:
        self.policy = policy
        self.state_policy = policy.state_policy()
        self.hooks = hooks
        self.joiner = joiner
        self.actions = actions
        self.audit = audit
        self.timelines = timelines
        self.budget = CancelBudget(policy.max_cancels_per_minute)
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._event_id = 0
        self._last: dict[int, tuple[str, str]] = {}

    def add_event(self, kind: str, **fields: Any) -> None:
        self._event_id += 1
        self.events.append(
            {"id": self._event_id, "ts_ns": time.monotonic_ns(), "kind": kind, **fields}
        )

    async def on_stalled(self, sample: SocketSample) -> float | None:
        """StallWatch's handler: decide, log, act. Returns when to look again, or None."""
        now_ns = time.monotonic_ns()
        engine = self.hooks.find(sample.local, sample.remote)
        view = self.joiner.view(sample, engine, now_ns, self.state_policy)
        decision = decide(candidate_of(view, now_ns), self.policy, self.budget, now_ns / 1e9)
        self.decisions[decision.verdict, decision.reason] += 1
        request_id = engine.request_id if engine is not None else None
        if self._last.get(sample.key) != (decision.verdict, decision.reason):
            self._last[sample.key] = (decision.verdict, decision.reason)
            entry = self.audit.record(
                decision, evidence_of(view, now_ns, self.state_policy), request_id=request_id
            )
            self.timelines.of(connection_id(sample.local, sample.remote)).add(
                now_ns,
                "decision",
                verdict=decision.verdict,
                reason=decision.reason,
                actions=list(decision.actions),
                evidence=entry["evidence"],
            )
            self.add_event(
                "decision",
                request_id=request_id,
                verdict=decision.verdict,
                reason=decision.reason,
                actions=list(decision.actions),
                local=str(sample.local),
                remote=str(sample.remote),
                evidence=entry["evidence"],
            )
        if decision.verdict == "act":
            await self._carry_out(view, decision, request_id)
        if decision.verdict == "skip" and decision.reason in TRANSIENT_REASONS:
            return RECHECK_SECONDS
        return None

    async def _carry_out(
        self, view: StreamView, decision: Decision, request_id: str | None
    ) -> None:
        evidence = evidence_of(view, view.now_ns, self.state_policy)
        for action in decision.actions:
            if action == "cancel":
                result = await self.actions.cancel(view, decision.reason, evidence)
            else:
                result = await self.actions.reset(view, decision.reason)
            self.audit.record_outcome(request_id, action, result)
            event = "cancel_acknowledged" if action == "cancel" else "reset_done"
            self.timelines.of(connection_id(view.sample.local, view.sample.remote)).add(
                time.monotonic_ns(), event, **result
            )
            self.add_event("outcome", request_id=request_id, action=action, **result)

    def forget(self, key: int) -> None:
        self._last.pop(key, None)
