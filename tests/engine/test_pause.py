"""Pausing and releasing on the real engine (tiny model, CPU): a paused request gets no step
while others progress, keeps its KV blocks and its place in the queue; released, it runs on and
its output is what it would have been unpaused. Renewals, a pause of a parked request, and the
engine with pausing off."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvwatch.errors import ConfigError
from kvwatch.lab.engine.config import EngineConfig
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.waiting import wait_until
from tests.engine.readers import (
    Reader,
    assert_all_free,
    generated,
    state_of,
    submit,
    wait_state,
)

pytestmark = pytest.mark.engine

PROMPT = "a prompt that pauses"


def kv_blocks_of(engine: Engine, reader: Reader) -> int:
    return next(r.kv_blocks for r in engine.stats().requests if r.request_id == reader.request_id)


def answer(engine: Engine, command: str, reader: Reader) -> str:
    status: str = getattr(engine, command)(reader.request_id, "test").status
    return status


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_paused_request_gets_no_step_while_others_progress_and_keeps_its_kv(
    make_engine: Callable[..., Engine], temperature: float
) -> None:
    engine = make_engine(debug_checks=True, egress="decoupled")  # no reader holds anything
    options = {"temperature": temperature, "seed": 11}
    expected = submit(engine, PROMPT, 300, **options).read_all()
    paused = submit(engine, PROMPT, 300, **options)
    wait_state(engine, paused, "running")
    assert answer(engine, "pause", paused) == "paused"
    tokens, blocks = generated(engine, paused.request_id), kv_blocks_of(engine, paused)
    other = submit(engine, "another prompt", 300)

    wait_until(lambda: generated(engine, other.request_id) >= 40, 20, "the other request's tokens")

    assert generated(engine, paused.request_id) == tokens
    assert kv_blocks_of(engine, paused) == blocks > 0
    assert state_of(engine, paused.request_id) == "paused"
    stats = engine.stats()
    assert (stats.paused, stats.num_pauses, stats.num_releases) == (1, 1, 0)
    metrics = engine.metrics.render().decode()
    assert "kvwatch_engine:num_requests_paused 1.0" in metrics
    assert "kvwatch_engine:num_pauses_total 1.0" in metrics

    assert answer(engine, "release", paused) == "released"
    paused.read_all()
    other.read_all()

    assert (paused.token_ids, paused.text) == (expected.token_ids, expected.text)
    assert not paused.resumes  # its KV never left
    assert "kvwatch_engine:num_releases_total 1.0" in engine.metrics.render().decode()
    assert_all_free(engine)


def test_a_paused_waiting_request_keeps_its_place_while_those_behind_it_are_admitted(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(max_running=1)
    holder = submit(engine, PROMPT, 40)
    first, second = submit(engine, PROMPT, 40), submit(engine, PROMPT, 40)
    wait_state(engine, holder, "egress_blocked")
    wait_state(engine, second, "waiting")
    assert answer(engine, "pause", first) == "paused"

    assert answer(engine, "park", holder) == "parked"  # the slot is free: the second gets it
    wait_state(engine, second, "egress_blocked")
    assert state_of(engine, first.request_id) == "paused"
    assert answer(engine, "release", first) == "released"
    assert state_of(engine, first.request_id) == "waiting"  # ahead of the parked holder
    assert answer(engine, "release", holder) == "released"  # now at the head: ahead of first
    second.read_all()
    wait_state(engine, first, "egress_blocked")  # the holder waits for its reader: first runs
    assert state_of(engine, holder.request_id) == "waiting"
    for reader in first, holder:
        reader.read_all()
    assert_all_free(engine)


def test_a_pause_renews_and_a_pause_of_a_parked_request_keeps_it_parked(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(debug_checks=True)
    expected = submit(engine, PROMPT, 60).read_all()
    reader = submit(engine, PROMPT, 60)
    wait_state(engine, reader, "egress_blocked")
    assert [answer(engine, "pause", reader) for _ in range(2)] == ["paused", "paused"]
    assert engine.stats().num_pauses == 1

    assert answer(engine, "park", reader) == "parked"  # a paused request parks
    assert answer(engine, "pause", reader) == "paused"  # a renewal: still parked
    assert state_of(engine, reader.request_id) == "parked"
    assert answer(engine, "release", reader) == "released"
    assert answer(engine, "release", reader) == "not_held"
    reader.read_all()

    assert (reader.token_ids, reader.text) == (expected.token_ids, expected.text)
    assert [recomputed for _blocks, recomputed in reader.resumes] == [0]
    assert_all_free(engine)


def test_pausing_off_fails_every_pause_and_release(make_engine: Callable[..., Engine]) -> None:
    with pytest.raises(ConfigError, match="parking needs pausing"):
        EngineConfig(pause=False).validate()
    engine = make_engine(pause=False, park=False)
    reader = submit(engine, PROMPT, 8)
    for command in "pause", "release":
        outcome = getattr(engine, command)(reader.request_id, "test")
        assert (outcome.status, outcome.detail) == ("failed", "pausing is off (--no-pause)")
    reader.read_all()
