"""Whether a KV transfer may still read or write a request's blocks, so a park must not free
them yet (seed 004's race: reclaim while a transfer is in flight).

vLLM calls a connector's `request_finished` only when a request finishes; a preemption — and a
park, which frees blocks the way a preemption does — never calls it. So the park asks here
first and is declined while this says a transfer is pending:

- the scheduler's own state: a request in WAITING_FOR_REMOTE_KVS (its KV is being loaded into
  blocks it already holds), or whose load finished or failed but has not been taken in yet, or
  whose load is deferred behind an in-flight step;
- the connector's word, for a connector that implements the optional method
  `kvwatch_transfer_pending(request) -> str | None` (a reason while a store, offload or
  transfer of that request's blocks is in flight, else None). A MultiConnector is asked
  through each of its connectors.

What neither says is covered the way vLLM covers its own preemptions: the park goes through
the scheduler's preemption path, so the request is in the next step's `preempted_req_ids`
(the worker's connector flushes that request's pending saves in `handle_preemptions` before
the blocks are overwritten: vLLM's contract for connectors with async saves, e.g. the
OffloadingConnector) and, with overlapping batches and a KV consumer, the blocks go back to
the pool only after the in-flight step (vLLM's deferred frees).
"""

from __future__ import annotations

from collections.abc import Iterator

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

TRANSFER_PENDING_METHOD = "kvwatch_transfer_pending"


def pending_transfer(scheduler: Scheduler, request: Request) -> str | None:
    """Why a transfer may still touch `request`'s blocks, or None when none can."""
    connector = scheduler.connector
    if connector is None:
        return None
    request_id = request.request_id
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        return "a KV load into its blocks is in flight (WAITING_FOR_REMOTE_KVS)"
    if request_id in scheduler.deferred_loads:
        return "a KV load into its blocks waits for an in-flight step to end"
    if request_id in scheduler.finished_recving_kv_req_ids:
        return "its KV load finished and the scheduler has not taken it in yet"
    if request_id in scheduler.failed_recving_kv_req_ids:
        return "its KV load failed and the scheduler has not handled it yet"
    for each in _connectors(connector):
        ask = getattr(each, TRANSFER_PENDING_METHOD, None)
        if ask is None:
            continue
        reason = ask(request)
        if reason:
            return f"{type(each).__name__}: {reason}"
    return None


def _connectors(connector: KVConnectorBase_V1) -> Iterator[KVConnectorBase_V1]:
    """The connector, or a MultiConnector's connectors (public `sub_connectors`)."""
    subs = getattr(connector, "sub_connectors", None)
    if subs is None:
        yield connector
        return
    for sub in subs:
        yield from _connectors(sub)
