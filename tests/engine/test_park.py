"""Parking and releasing on the real engine (tiny model, CPU): a park frees a request's KV
blocks at once, whether or not its writer is held by its client, and keeps its place and its
output; the request runs again only when released, ahead of new work, with its KV copied back
from host memory, and its output is what it would have been unparked. Declines and the other
statuses; cancel, abort and stop of parked requests; races with pauses, cancels and
preemption. Parks through the engine hook and over HTTP are in test_park_http.py, a park whose
copy is slow in test_park_transfer.py.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvwatch.lab.engine.attention import bytes_per_block
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.waiting import wait_until
from tests.engine.conftest import tiny_config
from tests.engine.readers import (
    Reader,
    assert_all_free,
    generated,
    state_of,
    submit,
    wait_state,
)

pytestmark = pytest.mark.engine

PROMPTS = ("park here", "a longer prompt that takes two blocks of sixteen tokens", "x")


def park(engine: Engine, reader: Reader) -> int:
    """Parks the request once it holds blocks; returns the blocks freed."""
    wait_until(
        lambda: any(
            r.request_id == reader.request_id and r.kv_blocks for r in engine.stats().requests
        ),
        20,
        f"{reader.request_id} holding blocks",
    )
    outcome = engine.park(reader.request_id, "test")
    assert outcome.status == "parked", outcome
    assert outcome.freed_bytes == outcome.freed_blocks * engine.description.bytes_per_block
    return outcome.freed_blocks


def release(engine: Engine, reader: Reader) -> None:
    outcome = engine.release(reader.request_id, "test")
    assert outcome.status == "released", outcome


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_park_frees_the_blocks_at_once_and_the_request_waits_for_its_release(
    make_engine: Callable[..., Engine], temperature: float
) -> None:
    # Decoupled: the output queue holds the whole answer, so the writer is never held.
    engine = make_engine(debug_checks=True, egress="decoupled")
    options = {"temperature": temperature, "seed": 5}
    expected = submit(engine, PROMPTS[1], 200, **options).read_all()
    reader = submit(engine, PROMPTS[1], 200, **options)
    wait_state(engine, reader, "running")
    held = engine.stats().kv_blocks_used

    freed = park(engine, reader)

    stats = engine.stats()
    assert freed > 0 and freed >= held  # it may have grown a block before the park
    assert stats.kv_blocks_used == 0
    assert (stats.parked, stats.num_parks, stats.num_resumes) == (1, 1, 0)
    assert stats.parked_host_bytes == freed * engine.description.bytes_per_block
    assert state_of(engine, reader.request_id) == "parked"
    assert reader.kv_reports[-1] == 0  # at once: before the answer came back
    metrics = engine.metrics.render().decode()
    assert "kvwatch_engine:num_requests_parked 1.0" in metrics
    assert "kvwatch_engine:num_parks_total 1.0" in metrics
    tokens = generated(engine, reader.request_id)
    reader.read_queued()
    time.sleep(0.2)  # deliberate: nothing may run while it is not released
    assert generated(engine, reader.request_id) == tokens
    assert not reader.resumes

    release(engine, reader)
    reader.read_all()

    assert reader.resumes == [(reader.resumes[0][0], 0)] and reader.resumes[0][0] > 0
    assert (reader.token_ids, reader.text) == (expected.token_ids, expected.text)
    assert reader.finish_reason == "length"
    assert (engine.stats().num_resumes, engine.stats().num_releases) == (1, 1)
    assert_all_free(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_repeated_parks_and_releases_give_the_unparked_output(
    make_engine: Callable[..., Engine], temperature: float
) -> None:
    # Each release copies the KV back into other blocks, across block boundaries.
    engine = make_engine(debug_checks=True)
    for seed, prompt in enumerate(PROMPTS):
        expected = submit(engine, prompt, 60, temperature=temperature, seed=seed).read_all()
        reader = submit(engine, prompt, 60, temperature=temperature, seed=seed)
        for _ in range(5):
            park(engine, reader)
            release(engine, reader)
            reader.read_batch()
        reader.read_all()
        assert len(reader.resumes) == 5
        assert (reader.token_ids, reader.text) == (expected.token_ids, expected.text), prompt
    assert_all_free(engine)


def test_a_released_request_goes_ahead_of_new_work(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running=1)
    parked = submit(engine, PROMPTS[0], 40)
    park(engine, parked)
    newcomer = submit(engine, PROMPTS[0], 40)  # takes the one running slot, blocks there
    wait_state(engine, newcomer, "egress_blocked")
    later = submit(engine, PROMPTS[0], 40)
    wait_state(engine, later, "waiting")

    release(engine, parked)  # at the head of the queue, once its reader has read
    wait_state(engine, parked, "waiting")
    parked.read_queued()
    park(engine, newcomer)  # frees the running slot: the released one gets it first
    wait_state(engine, parked, "egress_blocked")
    assert state_of(engine, later.request_id) == "waiting"
    release(engine, newcomer)
    for reader in parked, later, newcomer:  # one slot: each runs once the one before ended
        reader.read_all()
    assert_all_free(engine)


def test_the_statuses_of_parks_and_releases(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running=1)
    holder = submit(engine, PROMPTS[0], 40)
    queued = submit(engine, PROMPTS[0], 40)
    wait_state(engine, holder, "egress_blocked")
    wait_state(engine, queued, "waiting")

    no_blocks = engine.park(queued.request_id, "test")
    assert (no_blocks.status, no_blocks.freed_blocks) == ("declined", 0)
    assert "holds no KV blocks" in no_blocks.detail
    assert engine.release(holder.request_id, "test").status == "not_held"
    park(engine, holder)
    again = engine.park(holder.request_id, "test")
    assert (again.status, again.detail) == ("declined", "it is already parked")
    for command in engine.park, engine.release, engine.pause:
        assert command("park-never", "test").status == "unknown_request"

    release(engine, holder)
    for reader in queued, holder:  # one slot: the queued one got it when the holder parked
        reader.read_all()
    for command in engine.park, engine.release, engine.pause:
        assert command(holder.request_id, "test").status == "already_finished"


def test_host_memory_limit_declines_a_park(make_engine: Callable[..., Engine]) -> None:
    block_bytes = bytes_per_block(tiny_config().shape, tiny_config().block_size, torch.float32)
    engine = make_engine(park_host_kv_bytes=2 * block_bytes)
    fits, too_big = submit(engine, "x", 40), submit(engine, "y" * 40, 40)  # 1 and 3 blocks
    park(engine, fits)
    wait_state(engine, too_big, "egress_blocked")
    outcome = engine.park(too_big.request_id, "test")
    assert outcome.status == "declined"
    assert "limit" in outcome.detail
    assert engine.stats().parked_host_bytes == block_bytes
    release(engine, fits)
    for reader in fits, too_big:
        reader.read_all()


def test_park_off_fails_every_park(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(park=False)
    reader = submit(engine, PROMPTS[0], 20)
    wait_state(engine, reader, "egress_blocked")
    outcome = engine.park(reader.request_id, "test")
    assert (outcome.status, outcome.freed_blocks) == ("failed", 0)
    assert "--no-park" in outcome.detail
    reader.read_all()


def test_cancel_of_a_parked_request_ends_it_and_frees_its_host_copy(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(debug_checks=True)
    reader = submit(engine, PROMPTS[1], 200)
    park(engine, reader)
    outcome = engine.cancel(reader.request_id, "the proof came")
    assert (outcome.status, outcome.freed_blocks, outcome.freed_bytes) == ("cancelled", 0, 0)
    assert reader.cancelled.is_set()
    reader.read_all()
    assert_all_free(engine)


def test_abort_of_a_parked_request_frees_its_host_copy(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(debug_checks=True)
    reader = submit(engine, PROMPTS[1], 200)
    park(engine, reader)
    engine.abort(reader.request_id)
    reader.read_all()
    assert reader.finish_reason == "abort"
    assert not reader.cancelled.is_set()
    assert_all_free(engine)


def test_stop_with_parked_requests_ends_them_all(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(debug_checks=True, max_running=1)
    parked = [submit(engine, prompt, 200) for prompt in PROMPTS]
    for reader in parked:
        park(engine, reader)
    blocker = submit(engine, PROMPTS[0], 200)
    wait_state(engine, blocker, "egress_blocked")
    released = parked[0]
    release(engine, released)  # not admitted (the blocker runs): its copy is still held
    wait_state(engine, released, "waiting")
    assert engine.stats().parked_host_bytes > 0
    engine.stop()
    for reader in (*parked, blocker):
        reader.read_all()
        assert reader.finish_reason == "abort"
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.parked, stats.parked_host_bytes) == (0, 0, 0)
    assert engine.park(released.request_id, "late").status == "failed"


@pytest.mark.slow
def test_parks_pauses_and_releases_racing_cancels_aborts_and_preemption_never_corrupt_kv(
    make_engine: Callable[..., Engine],
) -> None:
    # float64 so that batch composition cannot flip a greedy choice by rounding; a pool small
    # enough that requests are preempted and recomputed while the commands fly.
    settings: dict[str, Any] = {"dtype": "float64", "kv_blocks": 24, "debug_checks": True}
    rng = random.Random(7)
    workload = [(rng.choice(PROMPTS) * rng.randint(1, 3), rng.randint(24, 96)) for _ in range(24)]
    baseline_engine = make_engine(**settings)
    baseline = [submit(baseline_engine, p, n) for p, n in workload]
    join_all([threading.Thread(target=reader.read_all) for reader in baseline])

    engine = make_engine(**settings)
    readers = [submit(engine, p, n) for p, n in workload]
    outcomes: dict[str, list[str]] = {reader.request_id: [] for reader in readers}
    disturbing = threading.Event()
    disturbing.set()

    def read_and_release(reader: Reader, seed: int) -> None:
        pacing = random.Random(seed)
        while True:
            batch = reader.handle.channel.wait_batch(0.05)
            if batch is not None:
                reader.token_ids.extend(batch.token_ids)
                if batch.finish is not None:
                    reader.finish_reason = batch.finish.reason
                    return
            elif not disturbing.is_set():  # nothing came: it may be held, as a lease ends
                engine.release(reader.request_id, "lease")
            time.sleep(pacing.uniform(0.0, 0.01))  # deliberate: readers at uneven paces

    def disturb(seed: int) -> None:
        chaos = random.Random(seed)
        commands = (engine.park, engine.pause, engine.release, engine.cancel)
        for _ in range(80):
            time.sleep(chaos.uniform(0.0, 0.01))  # deliberate: each command at a random moment
            target = chaos.choice(readers).request_id
            if chaos.random() < 0.03:
                engine.abort(target)
                outcomes[target].append("abort")
            else:
                command = chaos.choices(commands, weights=(8, 8, 10, 1))[0]
                outcomes[target].append(command(target, "race").status)

    reading = [
        threading.Thread(target=read_and_release, args=(reader, index))
        for index, reader in enumerate(readers)
    ]
    for thread in reading:
        thread.start()
    join_all([threading.Thread(target=disturb, args=(seed,)) for seed in range(2)])
    disturbing.clear()
    join_all(reading, started=True)

    assert_all_free(engine)  # and debug_checks verified block ownership at every step
    seen = {status for statuses in outcomes.values() for status in statuses}
    assert {"parked", "paused", "released"} <= seen
    assert seen <= {
        "parked", "paused", "released", "declined", "not_held", "cancelled", "abort",
        "already_finished",
    }  # fmt: skip
    assert engine.stats().num_preemptions > 0
    for reader, expected in zip(readers, baseline, strict=True):
        if reader.finish_reason == "length":
            assert reader.token_ids == expected.token_ids, reader.request_id
        else:  # cut short by a cancel or an abort: a prefix of the same answer
            assert reader.token_ids == expected.token_ids[: len(reader.token_ids)]


def join_all(threads: list[threading.Thread], *, started: bool = False) -> None:
    if not started:
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join(60)
