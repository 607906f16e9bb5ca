"""What the agent decided and did, written once to each place people read it: the audit log,
the stream's timeline (`explain`), the event list the API streams, and the decision counts.

A decision is written when it is news for its stall episode (its verdict or reason changed),
so a long stall that stays denied is one line and one count, not one a second. An outcome
line carries its decision's reference (decision id, request id, addresses), never a position.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from kvwatch.act.audit import AuditLog
from kvwatch.policy.rules import Decision
from kvwatch.streams.episodes import Hold, Stall
from kvwatch.streams.timeline import Timelines, connection_id
from kvwatch.streams.view import StreamView

EVENTS_KEPT = 2000
# The timeline event of each action's outcome.
OUTCOME_EVENTS = {
    "cancel": "cancel_acknowledged",
    "reset": "reset_done",
    "park": "parked",
    "detach": "detached",
    "pause": "paused",
    "release": "released",
}


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


class Recorder:
    """Owns the audit log, the timelines' decision entries, the event list and the counts;
    used from the event loop."""

    def __init__(self, audit: AuditLog, timelines: Timelines) -> None:
        self.audit = audit
        self.timelines = timelines
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._event_id = 0
        self._decision_id = 0
        self._run_id = f"{time.time_ns() // 1_000_000:x}"

    def add_event(self, kind: str, **fields: Any) -> None:
        self._event_id += 1
        self.events.append(
            {"id": self._event_id, "ts_ns": time.monotonic_ns(), "kind": kind, **fields}
        )

    def events_after(self, since: int) -> list[dict[str, Any]]:
        return [event for event in self.events if event["id"] > since]

    def decision(
        self,
        view: StreamView,
        decision: Decision,
        part: Stall | Hold,
        kernel: dict[str, Any] | None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Counts and writes the decision when it is news for its part of the episode (the
        stall, for a cut; the hold, for a pause, park, detach or release); returns the
        reference that ties its outcome lines to it and the evidence it was written with."""
        news = (decision.verdict, decision.reason)
        if part.logged is not None and part.logged[0] == news:
            return part.logged[1], part.logged[2]
        self.decisions[news] += 1
        ref = self._reference(view)
        entry = self.audit.record(decision, evidence_of(view, kernel), ref)
        part.logged = (news, ref, entry["evidence"])
        fields = {
            "verdict": decision.verdict,
            "reason": decision.reason,
            "actions": list(decision.actions),
            "evidence": entry["evidence"],
        }
        self.note(view, view.now_ns, "decision", decision_id=ref["decision_id"], **fields)
        self.add_event("decision", **ref, **fields)
        return ref, entry["evidence"]

    def outcome(
        self, view: StreamView, ref: dict[str, Any], action: str, result: dict[str, Any]
    ) -> None:
        self.audit.record_outcome(ref, action, result)
        event = OUTCOME_EVENTS[action]
        self.note(view, time.monotonic_ns(), event, decision_id=ref["decision_id"], **result)
        self.add_event("outcome", **ref, action=action, **result)

    def note(self, view: StreamView, ts_ns: int, event: str, **fields: Any) -> None:
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

    def close(self) -> None:
        self.audit.close()
