"""The EngineCore end of the command path: two utility methods kvwatch adds to vLLM's
`EngineCore`, which the API server calls with `engine_core.call_utility_async(name, ...)`.

vLLM's EngineCore runs a utility call on its own thread, between engine steps (the busy loop
takes it from its input queue like a new request or an abort), so the scheduler is never
stepped while a hold changes, and a call wakes an idle engine loop. vLLM looks a utility up by
name on the EngineCore object (`getattr(engine_core, name)`), and has no hook for a
scheduler's own methods, so kvwatch's scheduler adds these two to the `EngineCore` class when
it is constructed (`install`): nothing of vLLM's is replaced, and an engine started without
kvwatch's scheduler answers "failed" with how to enable it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import EngineCore

from kvwatch_vllm.commands import HOLD_UTILITY, KV_STATE_UTILITY
from kvwatch_vllm.holds import RequestHolds
from kvwatch_vllm.outcome import COMMANDS, FAILED, PARK, PAUSE, RESUME, HoldResult

SCHEDULER_FLAG = "--scheduler-cls kvwatch_vllm.scheduler.KvwatchAsyncScheduler"
# How many of the requests that ended last `kvwatch_kv_state` reports.
RECENTLY_ENDED = 16


def kvwatch_hold(engine_core: EngineCore, command: str, request_ids: list[str]) -> list[Any]:
    """Runs `command` ("pause", "park" or "resume") on each vLLM request id; one
    `HoldResult.to_wire()` per id, in order."""
    scheduler = engine_core.scheduler
    if not isinstance(scheduler, RequestHolds):
        detail = (
            f"this engine runs {type(scheduler).__name__}, not kvwatch's scheduler "
            f"(start vLLM with {SCHEDULER_FLAG}, or KvwatchScheduler without async scheduling)"
        )
        return [
            HoldResult(rid, _known(command), FAILED, detail=detail).to_wire() for rid in request_ids
        ]
    run = {
        PAUSE: scheduler.pause_request,
        PARK: scheduler.park_request,
        RESUME: scheduler.resume_request,
    }.get(command)
    if run is None:
        detail = f"unknown command {command!r}; one of {', '.join(COMMANDS)}"
        return [HoldResult(rid, PARK, FAILED, detail=detail).to_wire() for rid in request_ids]
    return [run(request_id).to_wire() for request_id in request_ids]


def kvwatch_kv_state(engine_core: EngineCore, request_ids: list[str]) -> dict[str, Any]:
    """The free block count, the held requests, and the blocks each of `request_ids` holds
    and the tokens it has produced, the blocks of every live request (`live_blocks`), all read
    between the same two steps, and how the last RECENTLY_ENDED requests ended (`ended`: an
    aborted one says FINISHED_ABORTED, which vLLM's metrics do not count): what an operator (or
    a test) reads to see what a command did."""
    scheduler = engine_core.scheduler
    if not isinstance(scheduler, RequestHolds):
        return {"error": f"this engine runs {type(scheduler).__name__}, not kvwatch's scheduler"}
    return {
        "free_blocks": scheduler.free_block_count(),
        "total_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        "bytes_per_block": scheduler.bytes_per_block,
        "held": scheduler.held_requests(),
        "blocks": {rid: scheduler.request_block_count(rid) for rid in request_ids},
        "output_tokens": {
            rid: scheduler.requests[rid].num_output_tokens
            for rid in request_ids
            if rid in scheduler.requests
        },
        "live": sorted(scheduler.requests),
        "live_blocks": {rid: scheduler.request_block_count(rid) for rid in scheduler.requests},
        "ended": scheduler.recently_ended(RECENTLY_ENDED),
    }


def install() -> None:
    """Adds the two utilities to vLLM's EngineCore class; idempotent."""
    for name, function in ((HOLD_UTILITY, kvwatch_hold), (KV_STATE_UTILITY, kvwatch_kv_state)):
        present = getattr(EngineCore, name, None)
        if present is None:
            setattr(EngineCore, name, function)
        elif present is not function:
            raise RuntimeError(f"vLLM's EngineCore already has a {name!r}: not replacing it")


def _known(command: str) -> str:
    return command if command in COMMANDS else PARK
