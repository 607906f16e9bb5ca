"""The hold rule (kvwatch.policy.hold): a stream whose reader is behind is paused, one held
for park_seconds is parked (or detached), one whose reader caught up is released — all
without any proof of a stall; deny rules hold for every hold, grace and min_kv_bytes for a
park; streams it does not apply to are skipped quietly; observe mode holds nothing and says
each hold it would make once."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvwatch.config.schema import PolicyConfig
from kvwatch.policy.hold import NOT_NEWS, HoldSituation, decide_hold
from kvwatch.policy.rules import CancelBudget, Candidate, decide
from kvwatch.streams.states import StreamState
from tests.policy.test_rules import ENFORCE, MIB, stalled


def holdable(**changes: Any) -> Candidate:
    """A stream of an engine that can pause and park, not stalled (no proof of anything)."""
    base = stalled(state=StreamState.HEALTHY, stalled_seconds=0.0, can_park=True, can_pause=True)
    return dataclasses.replace(base, **changes)


def situation(**changes: Any) -> HoldSituation:
    """A reader 2.5 s of its stream behind, for 0.3 s, nothing held yet."""
    base = HoldSituation(
        behind=True,
        caught_up=False,
        backlog_seconds=2.5,
        behind_seconds=0.3,
        held="",
        held_seconds=0.0,
        decided=frozenset(),
    )
    return dataclasses.replace(base, **changes)


def test_a_reader_behind_gets_its_request_paused_without_proof() -> None:
    decision = decide_hold(holdable(), situation(), ENFORCE)
    assert (decision.verdict, decision.actions, decision.reason) == (
        "act",
        ("pause",),
        "reader_behind",
    )
    assert "2.50 s" in decision.detail and "pause_seconds 2.0" in decision.detail
    assert decide_hold(holdable(), situation(), PolicyConfig()).verdict == "would_act"


def test_paused_for_park_seconds_is_parked_and_caught_up_is_released() -> None:
    paused = situation(held="paused", held_seconds=2.1, decided=frozenset({"pause"}))
    park = decide_hold(holdable(), paused, ENFORCE)
    assert (park.actions, park.reason) == (("park",), "reader_still_behind")
    assert "64.0 MiB" in park.detail
    early = decide_hold(holdable(), dataclasses.replace(paused, held_seconds=1.0), ENFORCE)
    assert (early.verdict, early.reason) == ("skip", "not_yet")
    for held in ("paused", "parked"):
        back = situation(held=held, held_seconds=5.0, behind=False, caught_up=True)
        release = decide_hold(holdable(), back, ENFORCE)
        assert (release.verdict, release.actions, release.reason) == (
            "act",
            ("release",),
            "reader_caught_up",
        )
    still_between = situation(held="parked", held_seconds=5.0, behind=False, caught_up=False)
    assert decide_hold(holdable(), still_between, ENFORCE).reason == "holding"


def test_observe_mode_says_each_hold_once_and_parks_on_time_behind() -> None:
    observe = PolicyConfig()
    first = decide_hold(holdable(), situation(), observe)
    assert (first.verdict, first.actions) == ("would_act", ("pause",))
    later = situation(behind_seconds=2.5, decided=frozenset({"pause"}))
    assert decide_hold(holdable(), later, observe).actions == ("park",)
    done = situation(behind_seconds=9.0, decided=frozenset({"pause", "park"}))
    assert decide_hold(holdable(), done, observe).reason == "holding"


def test_an_engine_that_cannot_pause_is_parked_once_behind_for_park_seconds() -> None:
    park_only = holdable(can_pause=False)
    assert decide_hold(park_only, situation(), ENFORCE).reason == "not_yet"
    decision = decide_hold(park_only, situation(behind_seconds=2.0), ENFORCE)
    assert decision.actions == ("park",)
    detach_only = holdable(can_pause=False, can_park=False, can_detach=True)
    assert decide_hold(detach_only, situation(behind_seconds=2.0), ENFORCE).actions == ("detach",)
    paused_detachable = holdable(can_park=False, can_detach=True)
    held = situation(held="paused", held_seconds=2.0, decided=frozenset({"pause"}))
    assert decide_hold(paused_detachable, held, ENFORCE).actions == ("detach",)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"can_park": False, "can_pause": False}, "not_holdable"),
        ({"request_id": None, "has_engine_hook": False, "kv_bytes": None}, "not_holdable"),
        ({"relay_status": "relayed"}, "not_holdable"),  # the client socket at the proxy decides
        ({"relay_status": "ambiguous"}, "not_holdable"),
        ({"owner_pid": 0}, "owner_unknown"),
        ({"comm": "sshd"}, "denied_by_rule"),
    ],
)
def test_each_refusal_of_a_pause(changes: dict[str, Any], reason: str) -> None:
    config = dataclasses.replace(ENFORCE, deny_comms=("ssh*",))
    decision = decide_hold(holdable(**changes), situation(), config)
    assert (decision.verdict, decision.reason) == ("skip", reason)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"kv_bytes": 0}, "no_kv_held"),
        ({"age_seconds": 1.0}, "in_grace"),
        ({"kv_bytes": MIB}, "below_min_kv"),
    ],
)
def test_each_refusal_of_a_park(changes: dict[str, Any], reason: str) -> None:
    config = dataclasses.replace(ENFORCE, min_kv_bytes=2 * MIB)
    paused = situation(held="paused", held_seconds=3.0, decided=frozenset({"pause"}))
    decision = decide_hold(holdable(**changes), paused, config)
    assert (decision.verdict, decision.reason) == ("skip", reason)


def test_unknown_kv_is_not_zero_kv() -> None:
    """An ASGI app whose KV geometry the middleware cannot read reports an estimate of no
    blocks: it is still detached (it holds a generator), unless min_kv_bytes asks for a size."""
    unknown = holdable(
        can_pause=False, can_park=False, can_detach=True, kv_bytes=0, kv_estimated=True
    )
    assert decide_hold(unknown, situation(behind_seconds=2.0), ENFORCE).actions == ("detach",)
    strict = dataclasses.replace(ENFORCE, min_kv_bytes=MIB)
    assert decide_hold(unknown, situation(behind_seconds=2.0), strict).reason == "unknown_kv"


def test_a_release_needs_no_rule_to_pass() -> None:
    config = dataclasses.replace(ENFORCE, deny_comms=("*",))
    back = situation(held="paused", held_seconds=1.0, behind=False, caught_up=True)
    assert decide_hold(holdable(), back, config).actions == ("release",)


def test_holding_off_and_inapplicable_streams_are_not_news() -> None:
    off = dataclasses.replace(ENFORCE, pause="off", park="off")
    assert decide_hold(holdable(), situation(), off).reason == "hold_off"
    idle = situation(behind=False, caught_up=True, behind_seconds=0.0)
    assert decide_hold(holdable(), idle, ENFORCE).reason == "not_behind"
    assert {"hold_off", "not_holdable", "not_behind", "holding", "not_yet", "no_kv_held"} == (
        NOT_NEWS
    )
    pause_off = dataclasses.replace(ENFORCE, pause="off")
    assert decide_hold(holdable(), situation(behind_seconds=2.0), pause_off).actions == ("park",)


def test_a_parked_request_is_still_cut_when_stalled_and_min_kv_counts_what_it_parked() -> None:
    config = dataclasses.replace(ENFORCE, min_kv_bytes=2 * MIB)
    parked = stalled(kv_bytes=0, parked=True, parked_kv_bytes=64 * MIB, can_park=True)
    decision = decide(parked, config, CancelBudget(10), 100.0)
    assert (decision.verdict, decision.actions) == ("act", ("cancel",))
