"""The stall policy: whether to act on one stream, and how. Pure logic, no I/O, no clock.

`decide` checks, in this order, and the first check that fails names the decision's reason:
1. the stream is `stalled` (else "not_stalled"). The judge (kvwatch.streams.states.judge) alone says
   so: it has already required `stall_seconds` and the reader-rate guarantee;
2. the socket's owner is known ("owner_unknown"): deny and allow rules name processes and
   pods, so a socket whose owner cannot be found is never acted on;
3. no deny rule matches ("denied_by_rule") and every non-empty allow list does
   ("not_allowed_by_rule"). Behind a proxy the deny rules hold for the relaying process too;
3a. the engine's own socket behind a proxy, relayed to a client socket that carries its
   data, is not acted on ("relayed"): its stall is measured against the proxy's buffers,
   not the client's, and the client socket at the proxy decides (kvwatch.streams.relay);
   a proxy's client socket whose engine request has already ended pins no KV
   ("request_ended": the rest of the response waits in buffers and finishes on its own);
   one whose request kvwatch cancelled (judged first on the engine's own socket) is reset
   at once, whatever `policy.actions` says, so its client is not left waiting: the checks
   below are for the cancel, which is done;
4. the stream is at least `grace_seconds` old ("in_grace");
5. it holds at least `min_kv_bytes` ("below_min_kv"). A stream no engine announced has no known
   KV size: with `min_kv_bytes` = 0 it qualifies, for the `reset` action only (cancel needs the
   engine's hook); with `min_kv_bytes` > 0 it is skipped ("unknown_kv"), because the policy
   cannot tell it holds that much;
6. one of the configured actions is possible: `cancel` needs an engine hook and a known request,
   `reset` is always possible ("no_action_possible"). A cancel of a request found through a
   proxy is followed by a reset of the proxy's client socket, so the client is not left
   hanging on a response that will never come;
7. the budget of `max_cancels_per_minute` has room ("budget_exhausted"). An action that took
   no effect (its target was already gone, or it failed) gives its unit back.
Then the verdict is "act" in enforce mode and "would_act" in observe mode. Observe mode takes
from the budget exactly as enforce mode does, so an observe run's audit log shows what enforce
would have done, budget refusals included. The caller decides once per stall episode: a stream
that got "act" or "would_act" is not decided again (else observe mode would spend the budget on
the same stream every tick).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from kvwatch.config.schema import PolicyConfig
from kvwatch.streams.states import StreamState

Verdict = Literal["act", "would_act", "skip"]
BUDGET_WINDOW_SECONDS = 60.0
_MIB = 1 << 20


@dataclass(frozen=True)
class Owner:
    """A process the rules name: its comm and, where known, its cgroup, container and pod."""

    comm: str
    cgroup_path: str = ""
    container_id: str = ""
    pod_uid: str = ""


@dataclass(frozen=True)
class Candidate:
    """Everything the policy needs to know about one stream at the time of the decision.

    `stalled_seconds` is how long every stall condition has held (0 when they do not);
    `owner_pid` the process that owns the socket (the announcing engine's, else the one the
    collector found; 0 when none was found);
    `kv_bytes` is None when no engine announced the stream; `age_seconds` counts from when the
    connection (or stream) was first seen; `has_engine_hook` says an engine announced it, so
    it can be cancelled. `relay` is the proxy that writes the socket and `relay_status` how
    its upstream joined the request (kvwatch.streams.relay); for the engine's own socket
    behind a proxy, the proxy that reads it and "relayed"; both None for a socket no relay
    writes or reads. `can_park` says the engine can park the request (kvwatch.policy.hold),
    `parked` that it is parked now, `parked_kv_bytes` the KV its park freed (taken back on
    resume); `can_detach` and `detached`, `can_pause` and `paused` the same for a detach and
    a pause; `kv_estimated` that `kv_bytes` is the engine hook's estimate.
    """

    request_id: str | None
    state: StreamState
    stalled_seconds: float
    owner_pid: int
    kv_bytes: int | None
    age_seconds: float
    local_port: int
    comm: str
    cgroup_path: str
    container_id: str
    pod_uid: str
    has_engine_hook: bool
    relay: Owner | None = None
    relay_status: str | None = None
    can_park: bool = False
    parked: bool = False
    parked_kv_bytes: int = 0
    can_detach: bool = False
    detached: bool = False
    can_pause: bool = False
    paused: bool = False
    kv_estimated: bool = False

    @property
    def owner(self) -> Owner:
        return Owner(self.comm, self.cgroup_path, self.container_id, self.pod_uid)

    @property
    def kv_unknown(self) -> bool:
        """The engine cannot tell the KV it holds: an estimate of no blocks (an ASGI app
        whose KV geometry is not configured). Unknown is not zero."""
        return self.kv_estimated and not self.kv_bytes

    @property
    def claimed_kv_bytes(self) -> int | None:
        """The KV the request holds, plus what a park freed and a resume takes back: what
        `min_kv_bytes` is compared with (a parked request holds none now)."""
        return None if self.kv_bytes is None else self.kv_bytes + self.parked_kv_bytes


@dataclass(frozen=True)
class Decision:
    """The outcome for one candidate: `actions` are what is done ("act") or would be done
    ("would_act"), empty for "skip"; `reason` is a short machine-friendly word, `detail` says
    the same for humans, with the numbers."""

    verdict: Verdict
    actions: tuple[str, ...]
    reason: str
    detail: str

    @property
    def acts(self) -> bool:
        """True for "act" and "would_act": the stream met the policy."""
        return self.verdict != "skip"


class CancelBudget:
    """At most `per_minute` takes in any rolling window of 60 s.

    Times are monotonic seconds that never decrease between calls. A take at time t counts
    until t + 60 s. Owned by the policy loop: not thread-safe.
    """

    def __init__(self, per_minute: int) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be >= 1, got {per_minute}")
        self.per_minute = per_minute
        self._taken_s: collections.deque[float] = collections.deque()

    def _expire(self, now_s: float) -> None:
        while self._taken_s and self._taken_s[0] <= now_s - BUDGET_WINDOW_SECONDS:
            self._taken_s.popleft()

    def remaining(self, now_s: float) -> int:
        self._expire(now_s)
        return self.per_minute - len(self._taken_s)

    def try_take(self, now_s: float) -> bool:
        """Takes one action from the budget if there is room; False (and nothing taken) if not."""
        if self.remaining(now_s) <= 0:
            return False
        self._taken_s.append(now_s)
        return True

    def give_back(self) -> None:
        """Returns the newest take: its action changed nothing (the target was gone)."""
        if self._taken_s:
            self._taken_s.pop()


def skip(reason: str, detail: str) -> Decision:
    return Decision("skip", (), reason, detail)


def _identities(owner: Owner) -> list[tuple[str, str]]:
    named = [
        ("cgroup", owner.cgroup_path),
        ("container", owner.container_id),
        ("pod", owner.pod_uid),
    ]
    return [(what, value) for what, value in named if value]


def _first_match(value: str, patterns: tuple[str, ...]) -> str | None:
    return next((pattern for pattern in patterns if fnmatchcase(value, pattern)), None)


def _denied(candidate: Candidate, config: PolicyConfig) -> str | None:
    if candidate.local_port in config.deny_ports:
        return f"local port {candidate.local_port} is in policy.deny_ports"
    owners = [("", candidate.owner)]
    if candidate.relay is not None:
        owners.append(("relay ", candidate.relay))
    for role, owner in owners:
        pattern = _first_match(owner.comm, config.deny_comms)
        if pattern is not None:
            return f"{role}comm {owner.comm!r} matches policy.deny_comms {pattern!r}"
        for what, value in _identities(owner):
            pattern = _first_match(value, config.deny_cgroups)
            if pattern is not None:
                return f"{role}{what} {value!r} matches policy.deny_cgroups {pattern!r}"
    return None


def _not_allowed(candidate: Candidate, config: PolicyConfig) -> str | None:
    if config.allow_ports and candidate.local_port not in config.allow_ports:
        return f"local port {candidate.local_port} is not in policy.allow_ports"
    if config.allow_comms and _first_match(candidate.comm, config.allow_comms) is None:
        return f"comm {candidate.comm!r} matches no policy.allow_comms pattern"
    if config.allow_cgroups and not any(
        _first_match(value, config.allow_cgroups) is not None
        for _, value in _identities(candidate.owner)
    ):
        return "neither cgroup, container nor pod matches a policy.allow_cgroups pattern"
    return None


def _refusal(candidate: Candidate, config: PolicyConfig) -> Decision | None:
    """The first of checks 1-5 (module docstring) that fails, as a skip; None if all pass."""
    if candidate.state is not StreamState.STALLED:
        return skip("not_stalled", f"state is {candidate.state.value}")
    refusal = owner_refusal(candidate, config)
    if refusal is not None:
        return refusal
    if candidate.relay_status == "relayed":
        return skip(
            "relayed",
            "the engine's peer is a proxy that relays this socket to a client socket "
            "carrying its data: that socket's stall decides, with the client's own buffers "
            "(the relay link names it)",
        )
    if candidate.relay_status == "request_ended":
        return skip(
            "request_ended",
            "the engine request behind this proxy socket has ended; the rest of its response "
            "waits in buffers and pins no KV",
        )
    if candidate.relay_status == "request_cancelled":
        return None
    return size_refusal(candidate, config, candidate.claimed_kv_bytes)


def owner_refusal(candidate: Candidate, config: PolicyConfig) -> Decision | None:
    """Checks 2 and 3 (module docstring): the owner is known, no deny rule matches and
    every allow list does; a skip naming the first that fails, or None."""
    if candidate.owner_pid <= 0:
        return skip(
            "owner_unknown",
            "no process owns the socket in this procfs (orphaned, or in a pid namespace the "
            "agent cannot see): rules cannot be checked; mount the host's /proc "
            "(--path.procfs) in a container",
        )
    denied = _denied(candidate, config)
    if denied is not None:
        return skip("denied_by_rule", denied)
    not_allowed = _not_allowed(candidate, config)
    if not_allowed is not None:
        return skip("not_allowed_by_rule", not_allowed)
    return None


def size_refusal(
    candidate: Candidate, config: PolicyConfig, kv_bytes: int | None
) -> Decision | None:
    """Checks 4 and 5 (module docstring) for a stream that holds (or will take back)
    `kv_bytes` of KV, None when no engine announced it; a skip, or None."""
    if candidate.age_seconds < config.grace_seconds:
        return skip(
            "in_grace",
            f"stream age {candidate.age_seconds:.2f} s < grace_seconds {config.grace_seconds} s",
        )
    if kv_bytes is None and config.min_kv_bytes > 0:
        return skip(
            "unknown_kv",
            f"no engine announced the stream; min_kv_bytes {config.min_kv_bytes} "
            "needs a known KV size",
        )
    if kv_bytes is not None and kv_bytes < config.min_kv_bytes:
        return skip(
            "below_min_kv",
            f"holds {kv_bytes} KV bytes < min_kv_bytes {config.min_kv_bytes}",
        )
    return None


def possible_actions(candidate: Candidate, config: PolicyConfig) -> tuple[str, ...]:
    """The configured actions that can be carried out on this stream, in configured order."""
    if candidate.relay_status == "request_cancelled":
        return ("reset",)  # the client socket of a request kvwatch already cancelled
    can_cancel = (
        candidate.has_engine_hook
        and candidate.request_id is not None
        and candidate.kv_bytes is not None
    )
    actions = tuple(action for action in config.actions if action == "reset" or can_cancel)
    if candidate.relay is not None and "cancel" in actions and "reset" not in actions:
        actions += ("reset",)  # the proxy's client socket, so the client is not left hanging
    return actions


def _describe_act(candidate: Candidate, actions: tuple[str, ...]) -> str:
    kv = (
        f"{candidate.kv_bytes / _MIB:.1f} MiB KV"
        if candidate.kv_bytes is not None
        else "unknown KV (no engine hook)"
    )
    return f"stalled {candidate.stalled_seconds:.2f} s, {kv}; {' + '.join(actions)}"


def decide(
    candidate: Candidate, config: PolicyConfig, budget: CancelBudget, now_s: float
) -> Decision:
    """The policy's decision for `candidate` at `now_s` (monotonic seconds); takes one unit of
    `budget` when the verdict is "act" or "would_act", nothing otherwise."""
    refusal = _refusal(candidate, config)
    if refusal is not None:
        return refusal
    actions = possible_actions(candidate, config)
    if not actions:
        return skip(
            "no_action_possible",
            f"policy.actions is {', '.join(config.actions)} but cancel needs an engine hook; "
            "add reset to act on streams of engines without it",
        )
    if not budget.try_take(now_s):
        return skip(
            "budget_exhausted",
            f"{budget.per_minute} actions in the last 60 s (max_cancels_per_minute)",
        )
    verdict: Verdict = "act" if config.enforce else "would_act"
    return Decision(verdict, actions, "stalled", _describe_act(candidate, actions))
