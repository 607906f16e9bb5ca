"""The policy's step: from a stalled stream's view to a decision. The rules are pure
(kvwatch.policy.rules); this module turns a `StreamView` into the `Candidate` they judge and
keeps the budget they draw on. No I/O: kvwatch.act carries the decision out and records it."""

from __future__ import annotations

from kvwatch.config.schema import PolicyConfig
from kvwatch.policy.hold import HoldSituation, decide_hold
from kvwatch.policy.rules import CancelBudget, Candidate, Decision, Owner, decide
from kvwatch.streams.view import StreamView

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
    "no_kv_held",  # a park's: the request gets its blocks once admitted
    "not_yet",  # a park's: held or behind, not for park_seconds yet
}


def retry_after(decision: Decision) -> float | None:
    """When a skipped stream is looked at again: soon for a reason that can change while the
    stall lasts, never (this episode) for the others."""
    transient = decision.verdict == "skip" and decision.reason in TRANSIENT_REASONS
    return RECHECK_SECONDS if transient else None


def began_ns(view: StreamView) -> int:
    """When the stream is known to have existed: its announcement or first sight, or the
    start of its stall if that is earlier (a stall older than the agent, dated from the
    kernel's clocks after a restart, is not a young stream, announced again or not)."""
    since = view.judgement.since_ns
    return min(view.opened_ns, since) if since else view.opened_ns


def candidate_of(view: StreamView) -> Candidate:
    sample, engine, process, now_ns = view.sample, view.engine, view.process, view.now_ns
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
        can_park=engine is not None and engine.can_park,
        parked=engine is not None and engine.parked,
        parked_kv_bytes=engine.parked_blocks * engine.bytes_per_block if engine else 0,
        can_detach=engine is not None and engine.can_detach,
        detached=engine is not None and engine.detached,
        can_pause=engine is not None and engine.can_pause,
        paused=engine is not None and engine.paused,
        kv_estimated=engine is not None and engine.kv_estimated,
    )


def _relay_owner(view: StreamView) -> Owner | None:
    if view.relay is None:
        return None
    process = view.relay_process
    if process is None:
        return Owner(view.relay.relay_comm)
    return Owner(process.comm, process.cgroup_path, process.container_id, process.pod_uid)


class Decider:
    """The policy with its budget of `max_cancels_per_minute`; owned by the event loop.
    Observe mode takes from the budget exactly as enforce does (kvwatch.policy.rules)."""

    def __init__(self, policy: PolicyConfig) -> None:
        self.policy = policy
        self.budget = CancelBudget(policy.max_cancels_per_minute)

    def decide(self, view: StreamView) -> Decision:
        return decide(candidate_of(view), self.policy, self.budget, view.now_ns / 1e9)

    def decide_hold(self, view: StreamView, now: HoldSituation) -> Decision:
        """Whether to pause, park, detach or release the stream now (kvwatch.policy.hold);
        takes no budget."""
        return decide_hold(candidate_of(view), now, self.policy)
