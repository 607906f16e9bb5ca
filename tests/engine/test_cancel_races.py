"""Cancels racing admissions, appends and preemptions: no block is ever owned twice, and every
request that survives produces exactly the tokens it produces without the cancels."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.requests import Completion, GenerationRequest, RequestHandle
from kvwatch.lab.waiting import wait_until

pytestmark = pytest.mark.engine

NUM_REQUESTS = 40
WORDS = ("kv", "cache", "block", "stall", "window", "token", "stream", "engine")


def workload(seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            request_id=f"r{index}",
            prompt_token_ids=[256, *" ".join(rng.choices(WORDS, k=rng.randint(1, 5))).encode()],
            max_tokens=rng.randint(8, 48),
        )
        for index in range(NUM_REQUESTS)
    ]


def collect_all(handles: dict[str, RequestHandle]) -> dict[str, Completion]:
    """Reads every handle on its own thread (coupled mode needs live readers)."""
    results: dict[str, Completion] = {}

    def read(request_id: str, handle: RequestHandle) -> None:
        results[request_id] = handle.collect(timeout_seconds=60.0)

    threads = [threading.Thread(target=read, args=item) for item in handles.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def run(
    engine: Engine, requests: list[GenerationRequest], cancel: Callable[[], None] | None
) -> dict[str, Completion]:
    handles: dict[str, RequestHandle] = {}
    canceller = threading.Thread(target=cancel) if cancel else None
    if canceller:
        canceller.start()
    for request in requests:
        handles[request.request_id] = engine.submit(request)
        time.sleep(0.002)  # deliberate: submissions spread out, for the cancels to race
    results = collect_all(handles)
    if canceller:
        canceller.join()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("egress", ["decoupled", "coupled"])
def test_cancels_racing_admissions_never_corrupt_kv(
    make_engine: Callable[..., Engine], egress: str
) -> None:
    # float64 so that batch composition cannot flip a greedy choice by rounding; a pool small
    # enough that requests are preempted and recomputed while the cancels fly.
    settings = {"dtype": "float64", "kv_blocks": 24, "egress": egress, "debug_checks": True}
    requests = workload(seed=5)
    baseline = run(make_engine(**settings), requests, cancel=None)

    engine = make_engine(**settings)
    targets = random.Random(9).sample([r.request_id for r in requests], k=NUM_REQUESTS // 2)
    outcomes: dict[str, CommandOutcome] = {}

    def cancel_some(ids: list[str]) -> None:
        rng = random.Random(ids[0])
        for request_id in ids:
            time.sleep(rng.uniform(0.0, 0.06))  # deliberate: each cancel at a random moment
            outcomes[request_id] = engine.cancel(request_id, "race test")

    def cancel_in_two_threads() -> None:
        threads = [threading.Thread(target=cancel_some, args=(targets[i::2],)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    raced = run(engine, requests, cancel=cancel_in_two_threads)

    assert engine.error is None  # debug_checks verified block ownership at every step
    statuses = {outcome.status for outcome in outcomes.values()}
    assert statuses <= {"cancelled", "already_finished", "unknown_request"}
    assert "cancelled" in statuses
    for request_id, result in raced.items():
        expected = baseline[request_id].token_ids
        outcome = outcomes.get(request_id)
        if outcome is not None and outcome.status == "cancelled":
            assert result.finish.cancelled
            assert result.token_ids == expected[: len(result.token_ids)]
            assert outcome.freed_bytes == outcome.freed_blocks * engine.description.bytes_per_block
        else:  # not cancelled: finished first, or the cancel overtook its submission
            assert result.finish.reason == "length"
            assert result.token_ids == expected, request_id
    wait_until(lambda: engine.stats().kv_blocks_used == 0, 20, "every KV block freed")
    assert engine.stats().num_preemptions > 0
