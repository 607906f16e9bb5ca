"""Parking and resuming on the real engine (tiny model, CPU): a request whose reader stops
gives its KV blocks back at once and keeps its place and its output; it resumes only once
its reader reads, ahead of new work, and its output is what it would have been unparked.
Declines; cancel, abort and stop of parked requests; races; the anti-re-park rule.
Parks through the engine hook and over HTTP are in test_park_http.py.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvwatch.engine.attention import bytes_per_block
from kvwatch.engine.engine import Engine
from kvwatch.engine.parking import HELD_SECONDS
from kvwatch.engine.requests import GenerationRequest, RequestHandle
from tests.engine.conftest import tiny_config
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

PROMPTS = ("park here", "a longer prompt that takes two blocks of sixteen tokens", "x")
WAIT_SECONDS = 20.0
_ids = itertools.count()


@dataclass
class Reader:
    """Reads one request's output on the test's thread, a batch at a time, and records what
    its callbacks said."""

    handle: RequestHandle = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    kv_reports: list[int] = field(default_factory=list)
    resumes: list[tuple[int, int]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = ""

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def kv_changed(self, kv_blocks: int, tokens_out: int) -> None:
        self.kv_reports.append(kv_blocks)

    def resumed(self, kv_blocks: int, recomputed_tokens: int) -> None:
        self.resumes.append((kv_blocks, recomputed_tokens))

    def read_batch(self) -> bool:
        """Reads what is queued (waiting for it); True once the finish record came."""
        batch = self.handle.channel.wait_batch(WAIT_SECONDS)
        assert batch is not None, f"{self.request_id} sent nothing"
        self.token_ids.extend(batch.token_ids)
        self.text += "".join(batch.texts)
        if batch.finish is not None:
            self.finish_reason = batch.finish.reason
        return batch.finish is not None

    def read_all(self) -> Reader:
        while not self.read_batch():
            pass
        return self


def submit(engine: Engine, prompt: str, max_tokens: int, **options: Any) -> Reader:
    """Submits a request (a fresh id) whose callbacks the returned reader records; nothing is
    read yet, so in coupled mode it blocks after `egress_queue_tokens` tokens."""
    reader = Reader()
    request = GenerationRequest(
        request_id=f"park-{next(_ids)}",
        prompt_token_ids=engine.tokenizer.encode(prompt),
        max_tokens=max_tokens,
        on_cancelled=reader.cancelled.set,
        on_kv_change=reader.kv_changed,
        on_resumed=reader.resumed,
        **options,
    )
    reader.handle = engine.submit(request)
    return reader


def state_of(engine: Engine, request_id: str) -> str:
    snapshot = next((r for r in engine.stats().requests if r.request_id == request_id), None)
    return "gone" if snapshot is None else snapshot.state


def wait_state(engine: Engine, reader: Reader, state: str) -> None:
    wait_until(
        lambda: state_of(engine, reader.request_id) == state,
        WAIT_SECONDS,
        lambda: f"{reader.request_id} {state} (it is {state_of(engine, reader.request_id)})",
    )


def park_blocked(engine: Engine, reader: Reader) -> int:
    """Waits until the request is blocked on its reader (and the reader has been away for
    HELD_SECONDS), parks it; returns the blocks freed."""
    wait_state(engine, reader, "egress_blocked")
    channel = reader.handle.channel
    wait_until(
        lambda: channel.held_seconds(time.monotonic_ns()) >= HELD_SECONDS,
        WAIT_SECONDS,
        "the reader held away",
    )
    outcome = engine.park(reader.request_id, "test")
    assert outcome.status == "parked", outcome
    assert outcome.freed_bytes == outcome.freed_blocks * engine.description.bytes_per_block
    return outcome.freed_blocks


def assert_all_free(engine: Engine) -> None:
    """Nothing held: no live request, no block, no host copy; block ownership consistent."""
    wait_until(lambda: not engine.stats().requests, WAIT_SECONDS, "every request ended")
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.parked, stats.parked_host_bytes) == (0, 0, 0)
    engine.kv.check_invariants()
    assert engine.error is None


def test_park_frees_the_blocks_at_once_and_keeps_the_request(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(debug_checks=True)
    reader = submit(engine, PROMPTS[1], 120)
    wait_state(engine, reader, "egress_blocked")
    held = engine.stats().kv_blocks_used
    assert held > 0

    freed = park_blocked(engine, reader)

    stats = engine.stats()
    assert freed == held
    assert stats.kv_blocks_used == 0
    assert (stats.parked, stats.num_parks, stats.num_resumes) == (1, 1, 0)
    assert stats.parked_host_bytes == freed * engine.description.bytes_per_block
    assert state_of(engine, reader.request_id) == "parked"
    assert reader.kv_reports[-1] == 0  # at once: before the answer came back
    assert not reader.handle.channel.is_spent()
    metrics = engine.metrics.render().decode()
    assert "kvwatch_engine:num_requests_parked 1.0" in metrics
    assert "kvwatch_engine:num_parks_total 1.0" in metrics
    host_bytes = float(stats.parked_host_bytes)
    assert f"kvwatch_engine:kv_cache_parked_host_bytes {host_bytes}" in metrics


def test_resumes_only_once_its_reader_reads_and_its_output_is_unchanged(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(debug_checks=True)
    expected = submit(engine, PROMPTS[1], 120).read_all()
    reader = submit(engine, PROMPTS[1], 120)
    park_blocked(engine, reader)
    time.sleep(0.3)  # deliberate: nothing may resume while the reader does not read
    assert state_of(engine, reader.request_id) == "parked"
    assert not reader.resumes

    reader.read_all()

    assert len(reader.resumes) == 1
    blocks, recomputed = reader.resumes[0]
    assert blocks > 0 and recomputed == 0
    assert (reader.token_ids, reader.text) == (expected.token_ids, expected.text)
    assert reader.finish_reason == "length"
    assert engine.stats().num_resumes == 1
    assert_all_free(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_repeated_parks_give_the_unparked_output(
    make_engine: Callable[..., Engine], temperature: float
) -> None:
    # Without the widened queue a request is parked again each time its reader pauses: each
    # resume copies its KV back into other blocks, across block boundaries.
    engine = make_engine(debug_checks=True, park_resume_buffer_tokens=0)
    for seed, prompt in enumerate(PROMPTS):
        expected = submit(engine, prompt, 60, temperature=temperature, seed=seed).read_all()
        reader = submit(engine, prompt, 60, temperature=temperature, seed=seed)
        for _ in range(5):
            park_blocked(engine, reader)
            reader.read_batch()
        reader.read_all()
        assert len(reader.resumes) == 5
        assert (reader.token_ids, reader.text) == (expected.token_ids, expected.text), prompt
    assert_all_free(engine)


def test_a_resumed_request_goes_ahead_of_new_work(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running=1, park_resume_buffer_tokens=0)  # resumed: blocks again
    parked = submit(engine, PROMPTS[0], 40)
    park_blocked(engine, parked)
    newcomer = submit(engine, PROMPTS[0], 40)  # takes the one running slot, blocks there
    wait_state(engine, newcomer, "egress_blocked")
    later = submit(engine, PROMPTS[0], 40)
    wait_state(engine, later, "waiting")

    parked.read_batch()  # its reader reads: it resumes, at the head of the queue
    wait_state(engine, parked, "waiting")
    park_blocked(engine, newcomer)  # frees the running slot: the resumed one gets it first
    wait_state(engine, parked, "egress_blocked")
    assert state_of(engine, later.request_id) == "waiting"
    for reader in parked, later, newcomer:  # one slot: each runs once the one before ended
        reader.read_all()
    assert_all_free(engine)


def test_park_is_declined_when_it_would_not_help(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running=1)
    holder = submit(engine, PROMPTS[0], 200)
    queued = submit(engine, PROMPTS[0], 200)
    wait_state(engine, holder, "egress_blocked")
    wait_state(engine, queued, "waiting")

    no_blocks = engine.park(queued.request_id, "test")
    assert (no_blocks.status, no_blocks.freed_blocks) == ("declined", 0)
    assert "holds no KV blocks" in no_blocks.detail
    park_blocked(engine, holder)
    again = engine.park(holder.request_id, "test")
    assert (again.status, again.detail) == ("declined", "it is already parked")
    assert engine.park("park-never", "test").status == "unknown_request"

    for reader in queued, holder:  # one slot: the queued one got it when the holder parked
        reader.read_all()
    assert engine.park(holder.request_id, "test").status == "already_finished"


def test_park_is_declined_when_the_client_reads(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(egress="decoupled")  # its queue holds the whole answer: never full
    reader = submit(engine, PROMPTS[0], 1000)
    wait_state(engine, reader, "running")
    outcome = engine.park(reader.request_id, "test")
    assert (outcome.status, outcome.freed_blocks) == ("declined", 0)
    assert "not held by its client" in outcome.detail
    reader.read_all()


def test_host_memory_limit_declines_a_park(make_engine: Callable[..., Engine]) -> None:
    block_bytes = bytes_per_block(tiny_config().shape, tiny_config().block_size, torch.float32)
    engine = make_engine(park_host_kv_bytes=2 * block_bytes)
    fits, too_big = submit(engine, "x", 200), submit(engine, "y" * 40, 200)  # 1 and 3 blocks
    park_blocked(engine, fits)
    wait_state(engine, too_big, "egress_blocked")
    outcome = engine.park(too_big.request_id, "test")
    assert outcome.status == "declined"
    assert "limit" in outcome.detail
    assert engine.stats().parked_host_bytes == block_bytes
    for reader in fits, too_big:
        reader.read_all()


def test_park_off_fails_every_park(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(park=False)
    reader = submit(engine, PROMPTS[0], 200)
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
    park_blocked(engine, reader)
    outcome = engine.cancel(reader.request_id, "the proof came")
    assert (outcome.status, outcome.freed_blocks, outcome.freed_bytes) == ("cancelled", 0, 0)
    assert reader.cancelled.is_set()
    reader.read_all()
    assert reader.handle.channel.is_spent()
    assert_all_free(engine)


def test_abort_of_a_parked_request_frees_its_host_copy(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(debug_checks=True)
    reader = submit(engine, PROMPTS[1], 200)
    park_blocked(engine, reader)
    engine.abort(reader.request_id)
    reader.read_all()
    assert reader.finish_reason == "abort"
    assert not reader.cancelled.is_set()
    assert_all_free(engine)


def test_stop_with_parked_requests_ends_them_all(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(debug_checks=True, max_running=1)
    parked = [submit(engine, prompt, 200) for prompt in PROMPTS]
    for reader in parked:
        park_blocked(engine, reader)
    blocker = submit(engine, PROMPTS[0], 200)
    wait_state(engine, blocker, "egress_blocked")
    resumed = parked[0]
    resumed.read_batch()  # resumed, not admitted (the blocker runs): its copy is still held
    wait_state(engine, resumed, "waiting")
    assert engine.stats().parked_host_bytes > 0
    engine.stop()
    for reader in (*parked, blocker):
        reader.read_all()
        assert reader.finish_reason == "abort"
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.parked, stats.parked_host_bytes) == (0, 0, 0)
    assert engine.park(resumed.request_id, "late").status == "failed"


def test_a_resumed_request_runs_to_its_end_and_is_not_parked_again(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    reader = submit(engine, PROMPTS[0], 300)
    park_blocked(engine, reader)
    reader.read_batch()  # one read, then the reader pauses again
    # Its queue now holds the rest of its answer: it runs to its end at engine speed and
    # frees its blocks there, while its reader still pauses.
    wait_until(lambda: not engine.stats().requests, WAIT_SECONDS, "the resumed request ended")
    assert engine.stats().kv_blocks_used == 0
    assert engine.park(reader.request_id, "test").status == "already_finished"
    reader.read_all()
    assert len(reader.token_ids) == 300
    assert engine.stats().num_parks == 1


def test_the_resume_buffer_budget_bounds_the_widened_queue(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(park_resume_buffer_tokens=50)
    reader = submit(engine, PROMPTS[0], 300)
    park_blocked(engine, reader)
    reader.read_batch()
    wait_state(engine, reader, "egress_blocked")  # 4 + 50 tokens queued, then blocked again
    assert reader.handle.channel.capacity == engine.config.egress_queue_tokens + 50
    park_blocked(engine, reader)  # so a second park is possible: the budget was spent
    reader.read_all()
    assert engine.stats().num_parks == 2

    # Its grant came back once its queue was spent: the next resumed request gets one.
    second = submit(engine, PROMPTS[0], 300)
    park_blocked(engine, second)
    second.read_batch()
    wait_state(engine, second, "egress_blocked")
    assert second.handle.channel.capacity == engine.config.egress_queue_tokens + 50
    second.read_all()


def test_parks_racing_finish_cancel_abort_and_preemption_never_corrupt_kv(
    make_engine: Callable[..., Engine],
) -> None:
    # float64 so that batch composition cannot flip a greedy choice by rounding; a pool small
    # enough that requests are preempted and recomputed while parks, cancels and aborts fly.
    settings: dict[str, Any] = {
        "dtype": "float64",
        "kv_blocks": 24,
        "debug_checks": True,
        "park_resume_buffer_tokens": 40,
    }
    rng = random.Random(7)
    workload = [(rng.choice(PROMPTS) * rng.randint(1, 3), rng.randint(24, 96)) for _ in range(24)]
    baseline_engine = make_engine(**settings)
    baseline = [submit(baseline_engine, p, n) for p, n in workload]
    baseline_readers = [threading.Thread(target=reader.read_all) for reader in baseline]
    for thread in baseline_readers:
        thread.start()
    for thread in baseline_readers:
        thread.join(60)

    engine = make_engine(**settings)
    readers = [submit(engine, p, n) for p, n in workload]
    outcomes: dict[str, list[str]] = {reader.request_id: [] for reader in readers}

    def read_with_pauses(reader: Reader, seed: int) -> None:
        pacing = random.Random(seed)
        while not reader.read_batch():
            # deliberate: readers pause, requests block, and now and then long enough to park
            pause = HELD_SECONDS * 1.5 if pacing.random() < 0.2 else pacing.uniform(0.0, 0.05)
            time.sleep(pause)

    def disturb(seed: int) -> None:
        chaos = random.Random(seed)
        for _ in range(60):
            time.sleep(chaos.uniform(0.0, 0.01))  # deliberate: each command at a random moment
            target = chaos.choice(readers).request_id
            action = chaos.choices(("park", "cancel", "abort"), weights=(16, 1, 1))[0]
            if action == "park":
                outcomes[target].append(engine.park(target, "race").status)
            elif action == "cancel":
                outcomes[target].append(engine.cancel(target, "race").status)
            else:
                engine.abort(target)
                outcomes[target].append("abort")

    threads = [
        threading.Thread(target=read_with_pauses, args=(reader, index))
        for index, reader in enumerate(readers)
    ] + [threading.Thread(target=disturb, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert_all_free(engine)  # and debug_checks verified block ownership at every step
    seen = {status for statuses in outcomes.values() for status in statuses}
    assert "parked" in seen
    assert seen <= {"parked", "declined", "cancelled", "abort", "already_finished"}
    assert engine.stats().num_preemptions > 0
    for reader, expected in zip(readers, baseline, strict=True):
        if reader.finish_reason == "length":
            assert reader.token_ids == expected.token_ids, reader.request_id
        else:  # cut short by a cancel or an abort: a prefix of the same answer
            assert reader.token_ids == expected.token_ids[: len(reader.token_ids)]
