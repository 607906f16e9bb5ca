"""The stall policy: each rule on its own, the budget, and properties over random streams."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.config.schema import PolicyConfig
from kvwatch.policy.rules import BUDGET_WINDOW_SECONDS, CancelBudget, Candidate, Owner, decide
from kvwatch.streams.states import StreamState

MIB = 1 << 20
ENFORCE = PolicyConfig(mode="enforce")
CGROUP = (
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice"
    "/cri-containerd-abcd.scope"
)


def stalled(**changes: Any) -> Candidate:
    """An announced stream, stalled long enough, holding 64 MiB: every rule lets it through."""
    base = Candidate(
        request_id="req-1",
        state=StreamState.STALLED,
        stalled_seconds=4.0,
        owner_pid=4242,
        kv_bytes=64 * MIB,
        age_seconds=30.0,
        local_port=8000,
        comm="python3",
        cgroup_path=CGROUP,
        container_id="ab" * 32,
        pod_uid="1234-5678",
        has_engine_hook=True,
    )
    return dataclasses.replace(base, **changes)


def decide_once(candidate: Candidate, config: PolicyConfig = ENFORCE) -> tuple[str, str]:
    decision = decide(candidate, config, CancelBudget(config.max_cancels_per_minute), 100.0)
    return decision.verdict, decision.reason


def test_a_stalled_stream_that_passes_every_rule_is_cancelled() -> None:
    decision = decide(stalled(), ENFORCE, CancelBudget(10), 100.0)
    assert (decision.verdict, decision.actions, decision.reason) == ("act", ("cancel",), "stalled")
    assert "64.0 MiB" in decision.detail
    assert decision.acts


def test_observe_mode_says_would_act() -> None:
    decision = decide(stalled(), PolicyConfig(), CancelBudget(10), 100.0)
    assert (decision.verdict, decision.actions) == ("would_act", ("cancel",))


@pytest.mark.parametrize("state", [s for s in StreamState if s is not StreamState.STALLED])
def test_every_state_but_stalled_is_skipped(state: StreamState) -> None:
    assert decide_once(stalled(state=state)) == ("skip", "not_stalled")


def test_the_judges_word_is_final() -> None:
    """How long is the judge's business (kvwatch.streams.states.judge): the policy does not judge
    the stall again, so a stall it calls stalled is one, however it was timed."""
    assert decide_once(stalled(stalled_seconds=0.5)) == ("act", "stalled")


def test_a_socket_without_a_known_owner_is_never_acted_on() -> None:
    """Deny rules name processes: with no owner they cannot be checked, so nothing is done,
    and the reason says so (and it is looked at again: the owner may turn up)."""
    assert decide_once(stalled(owner_pid=0)) == ("skip", "owner_unknown")
    assert decide_once(stalled(owner_pid=0, comm="")) == ("skip", "owner_unknown")


def test_an_action_that_took_no_effect_gives_its_budget_back() -> None:
    budget = CancelBudget(1)
    assert decide(stalled(), ENFORCE, budget, 100.0).acts
    assert decide(stalled(), ENFORCE, budget, 101.0).reason == "budget_exhausted"
    budget.give_back()
    assert decide(stalled(), ENFORCE, budget, 102.0).acts


def test_a_young_stream_is_in_grace() -> None:
    assert decide_once(stalled(age_seconds=1.5)) == ("skip", "in_grace")
    assert (
        decide_once(stalled(age_seconds=1.5), dataclasses.replace(ENFORCE, grace_seconds=0))[0]
        == "act"
    )


def test_min_kv_bytes() -> None:
    config = dataclasses.replace(ENFORCE, min_kv_bytes=100 * MIB)
    assert decide_once(stalled(), config) == ("skip", "below_min_kv")
    assert decide_once(stalled(kv_bytes=100 * MIB), config) == ("act", "stalled")


def test_a_stream_no_engine_announced_can_only_be_reset_and_only_without_min_kv() -> None:
    unannounced = stalled(request_id=None, kv_bytes=None, has_engine_hook=False)
    assert decide_once(unannounced) == ("skip", "no_action_possible")
    both = dataclasses.replace(ENFORCE, actions=("cancel", "reset"))
    decision = decide(unannounced, both, CancelBudget(10), 0.0)
    assert (decision.verdict, decision.actions) == ("act", ("reset",))
    assert "unknown KV" in decision.detail
    with_min = dataclasses.replace(both, min_kv_bytes=1)
    assert decide_once(unannounced, with_min) == ("skip", "unknown_kv")


def test_both_actions_in_configured_order() -> None:
    config = dataclasses.replace(ENFORCE, actions=("reset", "cancel"))
    assert decide(stalled(), config, CancelBudget(10), 0.0).actions == ("reset", "cancel")


@pytest.mark.parametrize(
    ("rules", "reason"),
    [
        ({"deny_ports": (8000,)}, "denied_by_rule"),
        ({"deny_comms": ("py*",)}, "denied_by_rule"),
        ({"deny_cgroups": ("*kubepods-burstable*",)}, "denied_by_rule"),
        ({"deny_cgroups": ("abab*",)}, "denied_by_rule"),  # container id
        ({"deny_cgroups": ("1234-5678",)}, "denied_by_rule"),  # pod uid
        ({"allow_ports": (9000,)}, "not_allowed_by_rule"),
        ({"allow_comms": ("vllm*",)}, "not_allowed_by_rule"),
        ({"allow_cgroups": ("/system.slice/*",)}, "not_allowed_by_rule"),
        ({"allow_ports": (8000,), "deny_comms": ("python3",)}, "denied_by_rule"),  # deny wins
        ({"allow_ports": (8000,), "allow_comms": ("python3",)}, "stalled"),
        ({"allow_cgroups": ("1234-*",)}, "stalled"),
        ({"deny_comms": ("Python3",)}, "stalled"),  # case-sensitive
    ],
)
def test_allow_and_deny_rules(rules: dict[str, tuple[object, ...]], reason: str) -> None:
    config = dataclasses.replace(ENFORCE, **rules)  # type: ignore[arg-type]
    assert decide_once(stalled(), config)[1] == reason


def test_empty_identities_never_match_a_cgroup_rule() -> None:
    bare = stalled(cgroup_path="", container_id="", pod_uid="")
    assert decide_once(bare, dataclasses.replace(ENFORCE, deny_cgroups=("*",)))[0] == "act"
    allow_any = dataclasses.replace(ENFORCE, allow_cgroups=("*",))
    assert decide_once(bare, allow_any)[1] == "not_allowed_by_rule"


def test_the_budget_refuses_beyond_its_rate_and_recovers_after_a_minute() -> None:
    budget = CancelBudget(3)
    verdicts = [decide(stalled(), ENFORCE, budget, t).verdict for t in (0.0, 1.0, 2.0, 59.9)]
    assert verdicts == ["act", "act", "act", "skip"]
    assert decide(stalled(), ENFORCE, budget, 59.9).reason == "budget_exhausted"
    assert budget.remaining(59.9) == 0
    assert budget.remaining(60.0) == 1  # the take at 0.0 has expired
    assert decide(stalled(), ENFORCE, budget, 60.0).verdict == "act"


def test_skips_take_nothing_from_the_budget() -> None:
    budget = CancelBudget(1)
    decide(stalled(state=StreamState.SLOW), ENFORCE, budget, 0.0)
    decide(stalled(age_seconds=0.0), ENFORCE, budget, 0.0)
    assert budget.remaining(0.0) == 1


def test_observe_mode_spends_the_budget_like_enforce() -> None:
    budget = CancelBudget(1)
    observe = PolicyConfig()
    assert decide(stalled(), observe, budget, 0.0).verdict == "would_act"
    assert decide(stalled(), observe, budget, 1.0).reason == "budget_exhausted"


def test_a_budget_needs_room_for_one() -> None:
    with pytest.raises(ValueError):
        CancelBudget(0)


# --- properties over random streams ---------------------------------------------------------

candidates = st.builds(
    Candidate,
    request_id=st.one_of(st.none(), st.just("req")),
    state=st.one_of(st.just(StreamState.STALLED), st.sampled_from(list(StreamState))),
    stalled_seconds=st.floats(0, 20),
    owner_pid=st.sampled_from([0, 4242]),
    kv_bytes=st.one_of(st.none(), st.integers(0, 1 << 34)),
    age_seconds=st.floats(0, 60),
    local_port=st.sampled_from([80, 8000, 8001]),
    comm=st.sampled_from(["python3", "vllm", "nginx"]),
    cgroup_path=st.sampled_from(["", "/", "/system.slice/engine.service"]),
    container_id=st.sampled_from(["", "c" * 64]),
    pod_uid=st.sampled_from(["", "pod-a"]),
    has_engine_hook=st.booleans(),
)
configs = st.builds(
    PolicyConfig,
    mode=st.sampled_from(["observe", "enforce"]),
    actions=st.sampled_from([("cancel",), ("reset",), ("cancel", "reset")]),
    stall_seconds=st.floats(0.1, 10),
    min_kv_bytes=st.sampled_from([0, 1 << 20]),
    grace_seconds=st.floats(0, 10),
    max_cancels_per_minute=st.integers(1, 5),
    deny_ports=st.sampled_from([(), (80,)]),
    deny_comms=st.sampled_from([(), ("nginx",), ("v*",)]),
    deny_cgroups=st.sampled_from([(), ("/system.slice/*",), ("pod-a",)]),
    allow_ports=st.sampled_from([(), (8000, 8001)]),
)


# What each sampled deny pattern matches among the sampled values: an oracle without fnmatch.
DENIED_COMMS: dict[tuple[str, ...], set[str]] = {
    (): set(),
    ("nginx",): {"nginx"},
    ("v*",): {"vllm"},
}
DENIED_IDENTITIES: dict[tuple[str, ...], set[str]] = {
    (): set(),
    ("/system.slice/*",): {"/system.slice/engine.service"},
    ("pod-a",): {"pod-a"},
}


def is_denied(candidate: Candidate, config: PolicyConfig) -> bool:
    identities = {candidate.cgroup_path, candidate.container_id, candidate.pod_uid}
    return (
        candidate.local_port in config.deny_ports
        or candidate.comm in DENIED_COMMS[config.deny_comms]
        or bool(identities & DENIED_IDENTITIES[config.deny_cgroups])
    )


@settings(max_examples=300, deadline=None)
@given(config=configs, stream=st.lists(st.tuples(st.floats(0, 5), candidates), max_size=60))
def test_decisions_never_break_the_rules(
    config: PolicyConfig, stream: list[tuple[float, Candidate]]
) -> None:
    budget = CancelBudget(config.max_cancels_per_minute)
    now_s = 1000.0
    acted_at: list[float] = []
    for step_s, candidate in stream:
        now_s += step_s
        decision = decide(candidate, config, budget, now_s)
        if not decision.acts:
            assert decision.actions == ()
            continue
        acted_at.append(now_s)
        assert decision.verdict == ("act" if config.mode == "enforce" else "would_act")
        assert candidate.state is StreamState.STALLED
        assert candidate.owner_pid > 0
        assert candidate.age_seconds >= config.grace_seconds
        assert not is_denied(candidate, config)
        assert not config.allow_ports or candidate.local_port in config.allow_ports
        assert decision.actions and set(decision.actions) <= set(config.actions)
        if "cancel" in decision.actions:
            assert candidate.has_engine_hook and candidate.kv_bytes is not None
        if candidate.kv_bytes is None:
            assert decision.actions == ("reset",) and config.min_kv_bytes == 0
        else:
            assert candidate.kv_bytes >= config.min_kv_bytes
    for index, start in enumerate(acted_at):
        in_window = [t for t in acted_at[index:] if t < start + BUDGET_WINDOW_SECONDS]
        assert len(in_window) <= config.max_cancels_per_minute


@given(candidate=candidates, config=configs)
def test_a_stream_that_is_not_stalled_is_always_skipped(
    candidate: Candidate, config: PolicyConfig
) -> None:
    if candidate.state is not StreamState.STALLED:
        decision = decide(candidate, config, CancelBudget(1), 0.0)
        assert (decision.verdict, decision.reason) == ("skip", "not_stalled")


@given(
    per_minute=st.integers(1, 5),
    steps_s=st.lists(st.floats(0, 30), max_size=80),
    enforce=st.booleans(),
)
def test_eligible_streams_get_exactly_what_the_budget_allows(
    per_minute: int, steps_s: list[float], enforce: bool
) -> None:
    """Every eligible stream acts while the rolling window has room, and only then."""
    config = PolicyConfig(
        mode="enforce" if enforce else "observe", max_cancels_per_minute=per_minute
    )
    budget = CancelBudget(per_minute)
    now_s = 0.0
    acted_at: list[float] = []
    for step_s in steps_s:
        now_s += step_s
        room = sum(t > now_s - BUDGET_WINDOW_SECONDS for t in acted_at) < per_minute
        decision = decide(stalled(), config, budget, now_s)
        assert decision.acts == room
        if decision.acts:
            acted_at.append(now_s)
        else:
            assert decision.reason == "budget_exhausted"


# Behind a proxy (kvwatch.streams.relay): the chain's request, the relay's identity.
NGINX = Owner("nginx", "/system.slice/nginx.service")


def test_a_request_found_through_a_proxy_is_cancelled_then_its_client_socket_reset() -> None:
    decision = decide(stalled(relay=NGINX, relay_status="joined"), ENFORCE, CancelBudget(10), 1.0)
    assert (decision.verdict, decision.actions) == ("act", ("cancel", "reset"))


def test_deny_rules_hold_for_the_relaying_process_too() -> None:
    config = dataclasses.replace(ENFORCE, deny_comms=("nginx",))
    assert decide_once(stalled(relay=NGINX, relay_status="joined"), config) == (
        "skip",
        "denied_by_rule",
    )
    by_cgroup = dataclasses.replace(ENFORCE, deny_cgroups=("/system.slice/*",))
    assert decide_once(stalled(relay=NGINX), by_cgroup) == ("skip", "denied_by_rule")


def test_a_proxy_socket_whose_request_ended_is_left_alone_even_with_reset() -> None:
    config = dataclasses.replace(ENFORCE, actions=("reset",))
    candidate = stalled(
        request_id=None, kv_bytes=None, has_engine_hook=False, comm="nginx",
        relay=NGINX, relay_status="request_ended",
    )  # fmt: skip
    assert decide_once(candidate, config) == ("skip", "request_ended")


def test_the_client_socket_of_a_request_kvwatch_cancelled_is_reset_whatever_the_actions() -> None:
    """The engine's own socket was judged first and its request cancelled: the client still
    waits at the proxy. Only deny rules still hold."""
    candidate = stalled(
        request_id=None, kv_bytes=None, has_engine_hook=False, comm="nginx", age_seconds=0.0,
        relay=NGINX, relay_status="request_cancelled",
    )  # fmt: skip
    with_kv_floor = dataclasses.replace(ENFORCE, min_kv_bytes=MIB, actions=("cancel",))
    decision = decide(candidate, with_kv_floor, CancelBudget(10), 1.0)
    assert (decision.verdict, decision.actions) == ("act", ("reset",))
    denied = dataclasses.replace(ENFORCE, deny_comms=("nginx",))
    assert decide_once(candidate, denied) == ("skip", "denied_by_rule")
