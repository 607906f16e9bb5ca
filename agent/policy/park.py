"""The park rule: whether to park (or detach) one stream now. Pure logic, no I/O, no clock.

Parking frees a request's KV and keeps the request and its connection; the engine resumes it
when its client reads again (docs/protocol.md, "Park and resume"). Detaching, for engines that
can detach but not park (the ASGI middleware), lets the generation run to its end into a
bounded host buffer, which frees the KV (or llama-cpp-python's lock) then (docs/protocol.md,
"Detach"). Neither cuts anyone or loses a byte, so neither needs proof that the reader is
gone, only back-pressure that has lasted `policy.park_seconds`. An engine that can do both is
parked: a park frees the KV at once and spends no compute on a client that may be gone,
where a detach frees it only when the generation ends. `decide_park` checks, in this order:
1. parking is on (`policy.park`; "park_off") and the stream can be parked or detached: an
   engine that says it can announced it on this very socket (behind a proxy: the engine's
   own socket, whose back-pressure is what pins the KV) and it is not parked or detached
   already ("not_parkable"); it holds KV now ("no_kv_held": looked at again, as a request
   waiting for admission gets its blocks). None of these skips is news: the caller does not
   write it down;
2. every stall condition has held for `park_seconds` ("not_yet");
3. the owner is known and the deny and allow rules pass, as for any action
   (kvwatch.policy.rules, checks 2-3);
4. the stream is past `grace_seconds` and holds at least `min_kv_bytes` (checks 4-5).
Then the verdict is "act" in enforce mode and "would_act" in observe mode, with the action
"park" (or "detach"). Parks and detaches take nothing from the budget of
`max_cancels_per_minute`: that bounds cuts.
"""

from __future__ import annotations

from kvwatch.config import PolicyConfig
from kvwatch.policy.rules import Candidate, Decision, Verdict, owner_refusal, size_refusal, skip

# Skips that say only that parking does not apply to the stream: never news for the audit.
# "no_kv_held" can change (a request waiting for admission gets its blocks): looked at again.
NOT_NEWS = {"park_off", "not_parkable", "not_yet", "no_kv_held"}
_MIB = 1 << 20


def relief_action(candidate: Candidate) -> str | None:
    """What frees the stream's KV without a cut: "park", else "detach", else None."""
    if candidate.can_park:
        return "park"
    return "detach" if candidate.can_detach else None


def _not_parkable(candidate: Candidate) -> str | None:
    if candidate.request_id is None or not candidate.has_engine_hook:
        return "no engine announced a request on this socket"
    if candidate.relay_status not in (None, "relayed"):
        return "a proxy's client socket: the engine's own socket is the one parked"
    if relief_action(candidate) is None:
        return "its engine can neither park nor detach (its hello's features)"
    if candidate.parked or candidate.detached:
        return "already parked" if candidate.parked else "already detached"
    return None


def decide_park(candidate: Candidate, config: PolicyConfig) -> Decision:
    """Whether to park `candidate` now (see the module docstring)."""
    if config.park == "off":
        return skip("park_off", "policy.park is off")
    not_parkable = _not_parkable(candidate)
    if not_parkable is not None:
        return skip("not_parkable", not_parkable)
    if not candidate.kv_bytes:
        return skip("no_kv_held", "it holds no KV now (waiting for admission, or preempted)")
    if candidate.stalled_seconds < config.park_seconds:
        return skip(
            "not_yet",
            f"back-pressure for {candidate.stalled_seconds:.2f} s < park_seconds "
            f"{config.park_seconds} s",
        )
    refusal = owner_refusal(candidate, config) or size_refusal(
        candidate, config, candidate.claimed_kv_bytes
    )
    if refusal is not None:
        return refusal
    verdict: Verdict = "act" if config.enforce else "would_act"
    action = relief_action(candidate)
    assert action is not None, "checked by _not_parkable"
    kv_mib = (candidate.kv_bytes or 0) / _MIB
    detail = (
        f"no ACK progress under back-pressure for {candidate.stalled_seconds:.2f} s "
        f"(park_seconds {config.park_seconds} s), {kv_mib:.1f} MiB KV; {action}"
    )
    return Decision(verdict, (action,), "backpressure", detail)
