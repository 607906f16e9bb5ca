"""vLLM's real scheduler, stepped offline: pause, park and resume of one request, on both
scheduling paths (sync: one batch in flight; async: the next batch scheduled before the last
one's tokens are in) and with prefix caching on and off. The model's tokens are
`tokens.next_token` of the whole sequence, so a resumed request that lost, repeated or
reordered anything would not match `expected_output`."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus

from kvwatch_vllm.outcome import (
    ALREADY_FINISHED,
    DECLINED,
    NOT_HELD,
    PARKED,
    PAUSED,
    RESUMED,
    UNKNOWN_REQUEST,
)
from tests.support.offline import BLOCK_SIZE, Setup, Stepper, make_request, make_scheduler
from tests.support.tokens import expected_output

SETUPS = [Setup(async_scheduling=a, prefix_caching=p) for a in (False, True) for p in (False, True)]
PROMPT_A = list(range(1, 41))  # 40 tokens: 3 blocks of 16
PROMPT_B = list(range(300, 340))
MAX_TOKENS = 24


@pytest.fixture(params=SETUPS, ids=lambda setup: setup.name)
def setup(request: pytest.FixtureRequest) -> Setup:
    param: Setup = request.param
    return param


def started(model_dir: Path, setup: Setup, *prompts: list[int]) -> Stepper:
    """A scheduler with requests A, B, … (one per prompt) prefilled and a few tokens in."""
    scheduler = make_scheduler(model_dir, setup)
    stepper = Stepper(scheduler, setup.async_scheduling)
    for name, prompt in zip("ABCDEFG", prompts, strict=False):
        stepper.add(make_request(scheduler, name, prompt, MAX_TOKENS))
    stepper.steps_of(4)
    assert all(stepper.tokens[name] for name in "ABCDEFG"[: len(prompts)])
    return stepper


def assert_exact(stepper: Stepper, prompts: dict[str, list[int]]) -> None:
    for name, prompt in prompts.items():
        assert stepper.tokens[name] == expected_output(prompt, MAX_TOKENS), name
        assert stepper.finished[name] == "length", name


def test_a_paused_request_gets_no_tokens_keeps_its_blocks_and_resumes_exactly(
    model_dir: Path, setup: Setup
) -> None:
    stepper = started(model_dir, setup, PROMPT_A, PROMPT_B)
    scheduler = stepper.scheduler
    in_flight = scheduler.requests["A"].num_output_placeholders
    blocks = scheduler.kv_cache_manager.get_block_ids("A")
    tokens_at_pause = len(stepper.tokens["A"])

    result = scheduler.pause_request("A")

    assert result.status == PAUSED, result
    assert scheduler.held_requests() == {"A": "paused"}
    assert scheduler.requests["A"] not in scheduler.running
    stepper.steps_of(2)  # a token already in flight (async) arrives within the pipeline
    tokens_a, tokens_b = len(stepper.tokens["A"]), len(stepper.tokens["B"])
    assert tokens_a - tokens_at_pause == in_flight  # 0 on the sync path
    stepper.steps_of(8)
    assert len(stepper.tokens["A"]) == tokens_a  # no tokens while paused
    assert len(stepper.tokens["B"]) > tokens_b  # while the other request goes on
    assert scheduler.kv_cache_manager.get_block_ids("A") == blocks  # its KV kept
    assert scheduler.max_num_active_reqs == scheduler.max_num_running_reqs - 1  # its slot kept

    result = scheduler.resume_request("A")

    assert result.status == RESUMED, result
    assert scheduler.running[0] is scheduler.requests["A"]
    assert scheduler.max_num_active_reqs == scheduler.max_num_running_reqs
    stepper.run_until_done()
    assert_exact(stepper, {"A": PROMPT_A, "B": PROMPT_B})


def test_a_parked_request_frees_its_blocks_at_once_and_resumes_exactly(
    model_dir: Path, setup: Setup
) -> None:
    stepper = started(model_dir, setup, PROMPT_A, PROMPT_B)
    scheduler = stepper.scheduler
    held = scheduler.request_block_count("A")
    free_before = scheduler.free_block_count()

    result = scheduler.park_request("A")

    # Right after the call: A's blocks are in the free pool, none shared (distinct prompts).
    assert result.status == PARKED, result
    assert held >= 3
    assert result.freed_blocks == held
    assert scheduler.free_block_count() - free_before == held
    assert result.freed_bytes == held * scheduler.bytes_per_block > 0
    assert scheduler.request_block_count("A") == 0
    assert scheduler.held_requests() == {"A": "parked"}
    request = scheduler.requests["A"]
    assert request not in scheduler.running and request not in scheduler.waiting

    stepper.steps_of(2)  # a token in flight when parked is delivered, not lost
    tokens_a = len(stepper.tokens["A"])
    stepper.steps_of(8)
    assert len(stepper.tokens["A"]) == tokens_a
    assert scheduler.request_block_count("A") == 0

    result = scheduler.resume_request("A")

    assert result.status == RESUMED, result
    assert scheduler.waiting.peek_request() is request
    stepper.step()
    assert "A" in stepper.scheduled[-1]  # re-admitted at once, ahead of nothing else waiting
    stepper.run_until_done()
    assert_exact(stepper, {"A": PROMPT_A, "B": PROMPT_B})


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_with_prefix_caching_a_park_frees_only_the_blocks_no_other_request_shares(
    model_dir: Path, async_scheduling: bool
) -> None:
    shared = list(range(500, 500 + 2 * BLOCK_SIZE))  # two full blocks both prompts begin with
    prompt_a, prompt_b = [*shared, *range(1, 9)], [*shared, *range(900, 908)]
    setup = Setup(async_scheduling=async_scheduling, prefix_caching=True)
    stepper = started(model_dir, setup, prompt_a)
    scheduler = stepper.scheduler
    stepper.add(make_request(scheduler, "B", prompt_b, MAX_TOKENS))
    stepper.steps_of(4)
    held = scheduler.request_block_count("A")
    free_before = scheduler.free_block_count()

    result = scheduler.park_request("A")

    assert result.status == PARKED, result
    assert result.freed_blocks == held - 2, result
    assert scheduler.free_block_count() - free_before == held - 2
    assert "2 shared with other requests" in result.detail
    assert scheduler.request_block_count("B") >= 2  # B keeps the shared prefix
    assert scheduler.resume_request("A").status == RESUMED
    stepper.run_until_done()
    assert_exact(stepper, {"A": prompt_a, "B": prompt_b})


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["prefix-off", "prefix-on"])
def test_a_resumed_parked_request_recomputes_only_what_the_prefix_cache_lost(
    model_dir: Path, prefix_caching: bool
) -> None:
    """How a parked request's KV comes back: recomputed, less its blocks still cached."""
    setup = Setup(async_scheduling=False, prefix_caching=prefix_caching)
    stepper = started(model_dir, setup, PROMPT_A)
    scheduler = stepper.scheduler
    assert scheduler.park_request("A").status == PARKED
    assert scheduler.resume_request("A").status == RESUMED
    sequence_length = scheduler.requests["A"].num_tokens

    stepper.step()

    recomputed = stepper.scheduled[-1]["A"]
    if prefix_caching:  # its freed full blocks still hold their hashes: a prefix hit
        cached = (sequence_length - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert (recomputed, cached) == (sequence_length - cached, 32)  # 12 of 44 here
    else:
        assert recomputed == sequence_length
    stepper.run_until_done()
    assert_exact(stepper, {"A": PROMPT_A})


def test_every_id_gets_its_documented_status_never_an_exception(
    model_dir: Path, setup: Setup
) -> None:
    stepper = started(model_dir, setup, PROMPT_A, PROMPT_B, list(range(600, 620)))
    scheduler = stepper.scheduler

    for command in (scheduler.pause_request, scheduler.park_request, scheduler.resume_request):
        assert command("no-such-request").status == UNKNOWN_REQUEST

    assert scheduler.resume_request("C").status == NOT_HELD

    scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    for command in (scheduler.pause_request, scheduler.park_request, scheduler.resume_request):
        result = command("B")
        assert result.status == ALREADY_FINISHED, result
        assert "FINISHED_ABORTED" in result.detail

    # Held, then aborted: the hold ends with the request; a paused one's slot comes back.
    assert scheduler.pause_request("C").status == PAUSED
    assert scheduler.pause_request("C").detail == "already paused"
    scheduler.finish_requests("C", RequestStatus.FINISHED_ABORTED)
    assert scheduler.held_requests() == {}
    assert scheduler.max_num_active_reqs == scheduler.max_num_running_reqs
    assert scheduler.resume_request("C").status == ALREADY_FINISHED

    # Pause then park: the park frees what the pause kept; a pause of a parked request (the
    # agent's lease renewal) answers paused and leaves it parked.
    held = scheduler.request_block_count("A")
    assert scheduler.pause_request("A").status == PAUSED
    park = scheduler.park_request("A")
    assert (park.status, park.freed_blocks) == (PARKED, held)
    assert scheduler.park_request("A").detail == "already parked"
    renewal = scheduler.pause_request("A")
    assert (renewal.status, renewal.detail) == (PAUSED, "parked: it stays parked")
    assert scheduler.held_requests()["A"] == "parked"
    assert scheduler.max_num_active_reqs == scheduler.max_num_running_reqs

    # A request not scheduled yet: no KV to keep (pause declined); a park holds it back.
    stepper.add(make_request(scheduler, "W", PROMPT_B, MAX_TOKENS))
    assert scheduler.pause_request("W").status == DECLINED
    park = scheduler.park_request("W")
    assert (park.status, park.freed_blocks) == (PARKED, 0)
    stepper.steps_of(4)
    assert not stepper.tokens["W"]

    assert scheduler.resume_request("A").status == RESUMED
    assert scheduler.resume_request("W").status == RESUMED
    stepper.run_until_done()
    assert_exact(stepper, {"A": PROMPT_A, "W": PROMPT_B})
    for command in (scheduler.pause_request, scheduler.park_request, scheduler.resume_request):
        result = command("A")
        assert result.status == ALREADY_FINISHED, result
        assert "finished" in result.detail


def test_the_engine_loop_sleeps_while_only_held_requests_remain(
    model_dir: Path, setup: Setup
) -> None:
    """vLLM's EngineCore blocks on its input queue when `has_requests()` is False; a held
    request must not keep it stepping (a resume, a utility call, wakes it)."""
    stepper = started(model_dir, setup, PROMPT_A, PROMPT_B)
    scheduler = stepper.scheduler
    assert scheduler.pause_request("A").status == PAUSED
    assert scheduler.park_request("B").status == PARKED
    stepper.drain()
    stepper.steps_of(3)
    assert not scheduler.has_requests()
    assert scheduler.resume_request("B").status == RESUMED
    assert scheduler.has_requests()
    assert scheduler.resume_request("A").status == RESUMED
    stepper.run_until_done()
    assert_exact(stepper, {"A": PROMPT_A, "B": PROMPT_B})
