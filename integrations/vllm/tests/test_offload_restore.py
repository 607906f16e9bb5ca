"""With vLLM's CPU offloading connector (OffloadingConnector, scheduler side; it builds on
CPU), where a parked request's KV comes back from on resume: the GPU prefix cache, host
memory, or a recompute. There is no worker here, so the test stands in for it the way the
deterministic model stands in for the model: each step it reports every transfer job the
connector's scheduler side submitted as done (a worker's `OffloadingWorkerMetadata`, and
`finished_recving` for a finished load). What is measured is vLLM's own decision on resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvwatch_vllm.outcome import PARKED, RESUMED
from tests.support.offline import Setup, Stepper, make_request, make_scheduler
from tests.support.tokens import expected_output

PROMPT = list(range(1, 41))
MAX_TOKENS = 24


def offloading(prefix_caching: bool) -> Setup:
    config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 64 << 20},
    )
    return Setup(False, prefix_caching, num_blocks=12, kv_transfer_config=config)


def step_with_worker(stepper: Stepper, steps: int = 1) -> None:
    """Steps, the stand-in worker reporting each submitted store and load as done."""
    jobs = stepper.scheduler.connector.connector_scheduler._jobs  # type: ignore[union-attr]
    for _ in range(steps):
        done = dict.fromkeys(jobs, 1)
        loads = {jobs[job].req_id for job in done if not jobs[job].is_store}
        stepper.connector_output = KVConnectorOutput(
            finished_recving=loads or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
        )
        stepper.step()


@pytest.mark.parametrize(
    ("prefix_caching", "evict", "from_host", "from_gpu_cache"),
    [(False, False, 32, 0), (True, False, 0, 32), (True, True, 32, 0)],
    ids=["prefix-off", "prefix-on-still-cached", "prefix-on-evicted"],
)
def test_where_a_parked_requests_kv_comes_back_from(
    model_dir: Path, prefix_caching: bool, evict: bool, from_host: int, from_gpu_cache: int
) -> None:
    scheduler = make_scheduler(model_dir, offloading(prefix_caching))
    stepper = Stepper(scheduler, async_scheduling=False)
    stepper.add(make_request(scheduler, "A", PROMPT, MAX_TOKENS))
    step_with_worker(stepper, 6)  # its two full blocks stored to host memory meanwhile
    request = scheduler.requests["A"]
    length = request.num_tokens  # 46
    assert scheduler.park_request("A").status == PARKED
    if evict:  # another request takes the pool: A's cached GPU blocks are evicted
        stepper.add(make_request(scheduler, "E", list(range(2000, 2150)), 4))
        step_with_worker(stepper, 8)
        assert stepper.finished["E"] == "length"
    assert scheduler.resume_request("A").status == RESUMED
    resumed_at = len(stepper.scheduled)

    step_with_worker(stepper)
    loaded = 0
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # a load from host memory
        loaded = request.num_computed_tokens
        step_with_worker(stepper, 2)
    recomputed = next(batch["A"] for batch in stepper.scheduled[resumed_at:] if "A" in batch)

    assert loaded == from_host
    assert recomputed == length - from_host - from_gpu_cache == 14
    step_with_worker(stepper, 40)
    assert stepper.tokens["A"] == expected_output(PROMPT, MAX_TOKENS)
