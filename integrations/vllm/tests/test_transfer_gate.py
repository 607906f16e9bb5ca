"""A park never frees blocks a KV transfer still reads or writes: with a KV connector of the
tests' own (tests.support.connector), a park is declined while the connector says a store of
the request's blocks is pending, and while the request's KV is being loaded
(WAITING_FOR_REMOTE_KVS) or its finished load is not taken in yet."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvwatch_vllm.outcome import DECLINED, PARKED, PAUSED, RESUMED
from tests.support.connector import REMOTE_LOAD_PARAM, PendingTransferConnector
from tests.support.offline import Setup, Stepper, make_request, make_scheduler
from tests.support.tokens import expected_output

PROMPT = list(range(1, 41))
MAX_TOKENS = 16


def connector_setup(async_scheduling: bool) -> Setup:
    config = KVTransferConfig(
        kv_connector=PendingTransferConnector.__name__,
        kv_connector_module_path="tests.support.connector",
        kv_role="kv_both",
    )
    return Setup(async_scheduling=async_scheduling, prefix_caching=True, kv_transfer_config=config)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_park_is_declined_while_a_store_of_its_blocks_is_pending(
    model_dir: Path, async_scheduling: bool
) -> None:
    scheduler = make_scheduler(model_dir, connector_setup(async_scheduling))
    connector = scheduler.connector
    assert isinstance(connector, PendingTransferConnector)
    stepper = Stepper(scheduler, async_scheduling)
    stepper.add(make_request(scheduler, "A", PROMPT, MAX_TOKENS))
    stepper.steps_of(4)
    blocks = scheduler.kv_cache_manager.get_block_ids("A")
    connector.pending_stores["A"] = "a store of its blocks to host memory is in flight"

    result = scheduler.park_request("A")

    assert result.status == DECLINED, result
    assert "store of its blocks to host memory" in result.detail
    assert scheduler.kv_cache_manager.get_block_ids("A") == blocks  # nothing freed
    assert scheduler.held_requests() == {}
    assert scheduler.pause_request("A").status == PAUSED  # a pause frees nothing: allowed
    assert scheduler.park_request("A").status == DECLINED

    del connector.pending_stores["A"]  # the store ended
    free_before = scheduler.free_block_count()
    result = scheduler.park_request("A")
    assert (result.status, result.freed_blocks) == (PARKED, len(blocks[0]))
    stepper.drain()  # async: vLLM returns them once the step in flight is taken in
    assert scheduler.free_block_count() - free_before == result.freed_blocks
    assert "A" not in connector.finished  # a park is not a finish: request_finished not called
    assert not scheduler.has_requests()  # a parked request does not keep the engine stepping
    assert scheduler.resume_request("A").status == RESUMED
    stepper.run_until_done()
    assert stepper.tokens["A"] == expected_output(PROMPT, MAX_TOKENS)


def test_a_park_is_declined_while_its_kv_is_being_loaded(model_dir: Path) -> None:
    scheduler = make_scheduler(model_dir, connector_setup(async_scheduling=False))
    stepper = Stepper(scheduler, async_scheduling=False)
    request = make_request(scheduler, "R", PROMPT, MAX_TOKENS)
    request.kv_transfer_params = {REMOTE_LOAD_PARAM: 32}
    stepper.add(request)
    stepper.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = scheduler.request_block_count("R")
    assert held > 0

    result = scheduler.park_request("R")

    assert result.status == DECLINED, result
    assert "WAITING_FOR_REMOTE_KVS" in result.detail
    assert scheduler.request_block_count("R") == held

    # The worker reports the load done; until the scheduler has taken it in, still declined.
    stepper.connector_output = KVConnectorOutput(finished_recving={"R"})
    stepper.step()
    if "R" in scheduler.finished_recving_kv_req_ids:
        assert scheduler.park_request("R").status == DECLINED
    stepper.steps_of(3)
    assert request.is_finished() is False
    assert request in scheduler.running
    result = scheduler.park_request("R")
    assert result.status == PARKED, result
    assert result.freed_blocks > 0
