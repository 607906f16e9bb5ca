"""From a stalled socket to a decision, its evidence, the audit line and the action."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvwatch.act.actions import Actions
from kvwatch.collect.table import ConnectionKey, connection_key
from kvwatch.config import PolicyConfig
from kvwatch.hookserver.registry import EngineStream
from kvwatch.policy.audit import AuditLog
from kvwatch.policy.rules import CancelBudget, Candidate, Decision, Owner, decide
from kvwatch.sockets import SocketSample
from kvwatch.streams.join import Joiner, StreamView
from kvwatch.streams.relay import Cancels, RelayLink
from kvwatch.streams.stall_timers import episode_of
from kvwatch.streams.states import StallJudgement
from kvwatch.streams.timeline import Timelines, connection_id

log = logging.getLogger(__name__)

RECHECK_SECONDS = 1.0
# Reasons that can change while the stall lasts: look again later instead of giving up.
TRANSIENT_REASONS = {
    "in_grace",
    "budget_exhausted",
    "unknown_kv",
    "below_min_kv",
    "no_action_possible",
    "owner_unknown",
    "unconfirmed",
    "relayed",  # the client socket that decides for it may go, leaving it to be judged alone
}
# Action results that changed nothing: the target was already gone, or the action failed.
# They give their budget unit back.
TOOK_EFFECT = {"cancelled", "reset"}
# An action that failed (or raised) is tried again after each of these delays, within its
# stall episode and on the kernel's confirmation each time; the budget is charged once.
RETRY_DELAYS_SECONDS = (1.0, 2.0, 4.0)
EVENTS_KEPT = 2000


@dataclass
class Unfinished:
    """A decision to act whose actions have not all been carried out: `actions` are the
    ones still to try (in order), `tries` how often they were tried, `took_effect` whether
    any action of the decision did, `cancelled` whether its cancel did."""

    episode: int
    reason: str
    ref: dict[str, Any]
    evidence: dict[str, Any]
    actions: tuple[str, ...]
    tries: int = 0
    took_effect: bool = False
    cancelled: bool = False


def evidence_of(view: StreamView, kernel: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the decision was based on, for the audit log and `explain`: the stream as the
    `streams` contract spells it (the socket, the judge's required time and evidence, the
    join, whether the KV size is an estimate), whether the engine's egress buffer for it
    is full (decoupled egress: the stream's own evidence of a stall), and `kernel`, what
    sock_diag said of the socket when a decision to act was checked against it (null when
    none was)."""
    evidence = view.to_json()
    evidence["egress_buffer_full"] = view.engine.egress_buffer_full if view.engine else None
    evidence["kernel"] = kernel
    return evidence


def began_ns(view: StreamView) -> int:
    """When the stream is known to have existed: its announcement or first sight, or the
    start of its stall if that is earlier (a stall older than the agent, dated from the
    kernel's clocks after a restart, is not a young stream, announced again or not)."""
    since = view.judgement.since_ns
    return min(view.opened_ns, since) if since else view.opened_ns


def candidate_of(view: StreamView, now_ns: int) -> Candidate:
    sample, engine, process = view.sample, view.engine, view.process
    return Candidate(
        request_id=engine.request_id if engine is not None else None,
        state=view.state,
        stalled_seconds=view.judgement.stalled_seconds(now_ns),
        owner_pid=view.owner_pid,
        kv_bytes=view.kv_bytes,
        age_seconds=(now_ns - began_ns(view)) / 1e9,
        local_port=sample.local.port,
        comm=process.comm if process is not None else sample.comm,
        cgroup_path=process.cgroup_path if process is not None else "",
        container_id=process.container_id if process is not None else "",
        pod_uid=process.pod_uid if process is not None else "",
        has_engine_hook=engine is not None,
        relay=_relay_owner(view),
        relay_status=view.relay.status if view.relay is not None else None,
    )


def _relay_owner(view: StreamView) -> Owner | None:
    if view.relay is None:
        return None
    process = view.relay_process
    if process is None:
        return Owner(view.relay.relay_comm)
    return Owner(process.comm, process.cgroup_path, process.container_id, process.pod_uid)


class Decider:
    """Decides on stalled sockets and carries the decisions out. Owned by the event loop.

    Invariants: at most one "act"/"would_act" decision per stall episode of a connection (its
    4-tuple in its namespace, however many views of it the collector has — sock_diag's
    bootstrap and BPF — and its kernel bytes_acked, see `episode_of`); a decision is written
    to the audit log, the event list and the decision counters when its verdict or reason
    differs from the last one for that episode, so a long stall that stays denied is one line
    and one count, not one a second; every action of an "act" decision ends in an outcome
    line: one that failed or raised is tried again (RETRY_DELAYS_SECONDS) while the episode
    lasts and the kernel still confirms it, and after its last try the stream is shown with
    its failed action (`failure_of`); a decision none of whose actions took effect (the
    target was gone, or they failed) gives its budget unit back."""

    def __init__(
        self,
        policy: PolicyConfig,
        behind: Callable[[SocketSample], tuple[EngineStream | None, RelayLink | None]],
        joiner: Joiner,
        actions: Actions,
        audit: AuditLog,
        timelines: Timelines,
    ) -> None:
        self.policy = policy
        self.state_policy = policy.state_policy()
        self.behind = behind
        self.joiner = joiner
        self.actions = actions
        self.audit = audit
        self.timelines = timelines
        self.budget = CancelBudget(policy.max_cancels_per_minute)
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._event_id = 0
        self._decision_id = 0
        self._run_id = f"{time.time_ns() // 1_000_000:x}"
        self._last: dict[
            ConnectionKey, tuple[tuple[int, str, str], dict[str, Any], dict[str, Any]]
        ] = {}
        self._acted: dict[ConnectionKey, int] = {}
        self._unfinished: dict[ConnectionKey, Unfinished] = {}
        self._failed: dict[ConnectionKey, tuple[int, dict[str, Any]]] = {}
        self.cancels = Cancels()

    def add_event(self, kind: str, **fields: Any) -> None:
        self._event_id += 1
        self.events.append(
            {"id": self._event_id, "ts_ns": time.monotonic_ns(), "kind": kind, **fields}
        )

    async def on_stalled(self, sample: SocketSample, judgement: StallJudgement) -> float | None:
        """The stall timers' handler: decide, log, act. Returns when to look again, or None."""
        episode, connection = episode_of(sample), connection_key(sample)
        unfinished = self._unfinished.get(connection)
        now_ns = time.monotonic_ns()
        engine, relay = self.behind(sample)
        view = self.joiner.view(sample, engine, now_ns, self.state_policy, judgement, relay)
        if unfinished is not None and unfinished.episode == episode:
            return await self._try_again(connection, view, unfinished)
        if self._acted.get(connection) == episode:
            return None
        decision = decide(candidate_of(view, now_ns), self.policy, self.budget, now_ns / 1e9)
        kernel: dict[str, Any] | None = None
        if decision.acts:
            view, decision, kernel = await self._confirmed(view, decision)
        ref, evidence = self._logged(view, decision, episode, kernel)
        if decision.acts:
            self._acted[connection] = episode
            self._unfinished.pop(connection, None)
        if decision.verdict == "act":
            unfinished = Unfinished(episode, decision.reason, ref, evidence, decision.actions)
            return await self._attempt(connection, view, unfinished)
        if decision.verdict == "skip" and decision.reason in TRANSIENT_REASONS:
            return RECHECK_SECONDS
        return None

    async def _try_again(
        self, connection: ConnectionKey, view: StreamView, unfinished: Unfinished
    ) -> float | None:
        """The next try of a decision's failed actions, if the kernel still shows the stall;
        else they are given up, each with an outcome line that says why."""
        confirmed = await self.actions.confirm(view)
        if confirmed.agrees:
            return await self._attempt(connection, view, unfinished)
        del self._unfinished[connection]
        for action in unfinished.actions:
            result = {"status": "abandoned", "detail": confirmed.detail}
            self._record_outcome(view, unfinished, action, result)
        self._settle(unfinished)
        return None

    async def _attempt(
        self, connection: ConnectionKey, view: StreamView, unfinished: Unfinished
    ) -> float | None:
        """Carries out the decision's remaining actions once; returns when to try the failed
        ones again, or None when nothing is left to try."""
        unfinished.tries += 1
        failed = await self._carry_out(view, unfinished)
        if not failed:
            self._unfinished.pop(connection, None)
            self._settle(unfinished)
            return None
        unfinished.actions = failed
        if unfinished.tries <= len(RETRY_DELAYS_SECONDS):
            self._unfinished[connection] = unfinished
            return RETRY_DELAYS_SECONDS[unfinished.tries - 1]
        self._unfinished.pop(connection, None)
        self._failed[connection] = (
            unfinished.episode,
            {"actions": list(failed), "tries": unfinished.tries, **unfinished.ref},
        )
        self._settle(unfinished)
        return None

    def _settle(self, unfinished: Unfinished) -> None:
        if not unfinished.took_effect:
            self.budget.give_back()

    def failure_of(self, sample: SocketSample) -> dict[str, Any] | None:
        """The actions that failed after their last try in this socket's current stall
        episode (`actions`, `tries`, the decision's reference), or None."""
        failed = self._failed.get(connection_key(sample))
        if failed is None or failed[0] != episode_of(sample):
            return None
        return failed[1]

    async def _confirmed(
        self, view: StreamView, decision: Decision
    ) -> tuple[StreamView, Decision, dict[str, Any] | None]:
        """The decision to act, held against the kernel's own view of the socket now
        (kvwatch.act.confirm): the view it rests on becomes that one; where the kernel does not
        show a stall, the decision becomes a skip and its budget unit is given back."""
        confirmed = await self.actions.confirm(view)
        view = self.joiner.view(
            confirmed.sample,
            view.engine,
            view.now_ns,
            self.state_policy,
            confirmed.judgement,
            view.relay,
        )
        if not confirmed.agrees:
            self.budget.give_back()
            decision = Decision("skip", (), confirmed.reason, confirmed.detail)
        return view, decision, confirmed.kernel

    def _logged(
        self, view: StreamView, decision: Decision, episode: int, kernel: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Counts and logs the decision when it is news for this episode; returns the
        reference that ties its outcome lines to it and the evidence it was logged with
        (gathered once per logged decision)."""
        sample, news = view.sample, (episode, decision.verdict, decision.reason)
        last = self._last.get(connection_key(sample))
        if last is not None and last[0] == news:
            return last[1], last[2]
        self.decisions[decision.verdict, decision.reason] += 1
        ref = self._reference(view)
        entry = self.audit.record(decision, evidence_of(view, kernel), ref)
        self._last[connection_key(sample)] = (news, ref, entry["evidence"])
        self._note(
            view,
            view.now_ns,
            "decision",
            decision_id=ref["decision_id"],
            verdict=decision.verdict,
            reason=decision.reason,
            actions=list(decision.actions),
            evidence=entry["evidence"],
        )
        self.add_event(
            "decision",
            **ref,
            verdict=decision.verdict,
            reason=decision.reason,
            actions=list(decision.actions),
            evidence=entry["evidence"],
        )
        return ref, entry["evidence"]

    def _note(self, view: StreamView, ts_ns: int, event: str, **fields: Any) -> None:
        """Adds an entry to the socket's timeline and, for a socket behind a proxy, to the
        timeline of the engine connection whose request it carries (so `explain` by request
        id shows what was decided at the proxy)."""
        sockets = {(view.sample.local, view.sample.remote)}
        if view.relay is not None and view.engine is not None:
            sockets.add((view.engine.local, view.engine.remote))  # the same one when relayed
        for local, remote in sockets:
            self.timelines.of(connection_id(local, remote)).add(ts_ns, event, **fields)

    def _reference(self, view: StreamView) -> dict[str, Any]:
        self._decision_id += 1
        engine = view.engine
        return {
            "decision_id": f"{self._run_id}-{self._decision_id}",
            "request_id": engine.request_id if engine is not None else None,
            "local": str(view.sample.local),
            "remote": str(view.sample.remote),
        }

    async def _carry_out(self, view: StreamView, unfinished: Unfinished) -> tuple[str, ...]:
        """Tries each remaining action once and writes its outcome; returns those that
        failed (an action that raised failed, with the exception as its detail)."""
        failed: list[str] = []
        for action in unfinished.actions:
            try:
                result = await self._act(view, unfinished, action)
            except Exception as exc:  # an action must end in an outcome, whatever went wrong
                log.exception("%s of %s failed", action, unfinished.ref["remote"])
                result = {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"}
            unfinished.took_effect = unfinished.took_effect or result["status"] in TOOK_EFFECT
            if result["status"] == "failed":
                failed.append(action)
            self._record_outcome(view, unfinished, action, result)
        return tuple(failed)

    async def _act(self, view: StreamView, unfinished: Unfinished, action: str) -> dict[str, Any]:
        if action == "cancel":
            result = await self.actions.cancel(view, unfinished.reason, unfinished.evidence)
            unfinished.cancelled = result["status"] == "cancelled"
            if unfinished.cancelled and view.engine is not None:
                self.cancels.add(view.engine, time.monotonic_ns())
        else:
            result = await self.actions.reset(
                view, unfinished.reason, follow=not unfinished.cancelled
            )
        if "freed_bytes" in result:
            result["estimated"] = unfinished.evidence["kv_estimated"]
        return result

    def _record_outcome(
        self, view: StreamView, unfinished: Unfinished, action: str, result: dict[str, Any]
    ) -> None:
        result = {**result, "attempt": unfinished.tries}
        ref = unfinished.ref
        self.audit.record_outcome(ref, action, result)
        event = "cancel_acknowledged" if action == "cancel" else "reset_done"
        self._note(view, time.monotonic_ns(), event, decision_id=ref["decision_id"], **result)
        self.add_event("outcome", **ref, action=action, **result)

    def forget(self, sample: SocketSample) -> None:
        """The socket closed: nothing of it is kept."""
        connection = connection_key(sample)
        for kept in (self._last, self._acted, self._unfinished, self._failed):
            kept.pop(connection, None)
        self.actions.checked.forget(sample.key)
