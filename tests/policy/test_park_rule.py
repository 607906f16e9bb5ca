"""The park rule (kvwatch.policy.park): a stream of an engine that can park, under
back-pressure for park_seconds, is parked without any proof of a stall; deny rules, grace
and min_kv_bytes hold as for the cut; streams it does not apply to are skipped quietly."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvwatch.config import PolicyConfig
from kvwatch.policy.park import NOT_NEWS, decide_park
from kvwatch.policy.rules import CancelBudget, Candidate, decide
from kvwatch.streams.states import StreamState
from tests.policy.test_rules import ENFORCE, MIB, stalled


def backed_up(**changes: Any) -> Candidate:
    """A stream under back-pressure for 2.5 s, not stalled (no proof yet), parkable."""
    base = stalled(state=StreamState.ZERO_WINDOW, stalled_seconds=2.5, can_park=True)
    return dataclasses.replace(base, **changes)


def test_back_pressure_for_park_seconds_parks_without_proof() -> None:
    decision = decide_park(backed_up(), ENFORCE)
    assert (decision.verdict, decision.actions, decision.reason) == (
        "act",
        ("park",),
        "backpressure",
    )
    assert "64.0 MiB" in decision.detail and "park_seconds 2.0" in decision.detail
    assert decide_park(backed_up(), PolicyConfig()).verdict == "would_act"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"stalled_seconds": 1.0}, "not_yet"),
        ({"can_park": False}, "not_parkable"),
        ({"parked": True}, "not_parkable"),
        ({"kv_bytes": 0}, "no_kv_held"),
        ({"request_id": None, "has_engine_hook": False, "kv_bytes": None}, "not_parkable"),
        ({"relay_status": "joined"}, "not_parkable"),  # a proxy's client socket
        ({"owner_pid": 0}, "owner_unknown"),
        ({"comm": "sshd"}, "denied_by_rule"),
        ({"age_seconds": 1.0}, "in_grace"),
        ({"kv_bytes": MIB}, "below_min_kv"),
    ],
)
def test_each_refusal(changes: dict[str, Any], reason: str) -> None:
    config = dataclasses.replace(ENFORCE, deny_comms=("ssh*",), min_kv_bytes=2 * MIB)
    decision = decide_park(backed_up(**changes), config)
    assert (decision.verdict, decision.reason) == ("skip", reason)


def test_park_off_and_inapplicable_streams_are_not_news() -> None:
    off = dataclasses.replace(ENFORCE, park="off")
    assert decide_park(backed_up(), off).reason == "park_off"
    assert {"park_off", "not_parkable", "not_yet", "no_kv_held"} == NOT_NEWS


def test_the_engines_own_socket_behind_a_proxy_is_parked() -> None:
    decision = decide_park(backed_up(relay_status="relayed"), ENFORCE)
    assert decision.verdict == "act"


def test_a_parked_request_is_still_cut_when_stalled_and_min_kv_counts_what_it_parked() -> None:
    config = dataclasses.replace(ENFORCE, min_kv_bytes=2 * MIB)
    parked = stalled(kv_bytes=0, parked=True, parked_kv_bytes=64 * MIB, can_park=True)
    decision = decide(parked, config, CancelBudget(10), 100.0)
    assert (decision.verdict, decision.actions) == ("act", ("cancel",))


def test_an_engine_that_can_only_detach_is_detached_and_one_that_can_both_is_parked() -> None:
    detach_only = decide_park(backed_up(can_park=False, can_detach=True), ENFORCE)
    assert (detach_only.verdict, detach_only.actions) == ("act", ("detach",))
    both = decide_park(backed_up(can_detach=True), ENFORCE)
    assert both.actions == ("park",)
    assert decide_park(
        backed_up(can_park=False, can_detach=True, detached=True), ENFORCE
    ).reason == ("not_parkable")
