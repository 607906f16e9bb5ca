"""Pause, park and resume one request inside vLLM's scheduler, on the kvwatch agent's word.

`RequestHolds` is mixed into vLLM's `Scheduler` (and `AsyncScheduler`: kvwatch_vllm.scheduler).
A held request is in none of the scheduler's queues — not `running`, not a waiting queue — so
`schedule()` never sees it; it stays in `requests`, so aborts, outputs already in flight and
`has_request` work as for any other request.

- **pause**: a running request leaves `running` and keeps its KV blocks and its running slot
  (admission counts it, as vLLM counts a streaming session waiting for input): it gets no
  tokens, and frees nothing. A token already in flight (async scheduling) still arrives.
- **park**: the request's blocks go back to the free pool at once, through the scheduler's
  own preemption (`_preempt_request`: the worker drops its state, stale in-flight output is
  delivered, not resampled), and it stays out of the waiting queue until resumed. With prefix
  caching only the blocks no other request shares are freed. Declined while a KV transfer may
  touch its blocks (kvwatch_vllm.transfers).
- **resume**: a paused request goes back to the head of `running` (it kept its blocks and its
  slot); a parked one to the head of the waiting queue, where vLLM re-admits it as it does a
  preempted request: from its prefix-cache hit, a KV connector's load, or by recomputing its
  prompt and output. Either way its next tokens are those it would have produced unheld.

All of this runs on the EngineCore's thread, between steps (kvwatch_vllm.engine_utility):
never concurrently with `schedule()` or `update_from_output()`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvwatch_vllm.outcome import (
    ALREADY_FINISHED,
    DECLINED,
    FAILED,
    NOT_HELD,
    PARK,
    PARKED,
    PAUSE,
    PAUSED,
    RESUME,
    RESUMED,
    UNKNOWN_REQUEST,
    HoldResult,
)
from kvwatch_vllm.transfers import pending_transfer

# How many ended request ids are remembered, so a late command answers "already_finished"
# rather than "unknown_request".
ENDED_MEMORY = 4096


@dataclass
class Hold:
    """A held request: `state` is PAUSED (keeps its blocks and running slot) or PARKED."""

    request: Request
    state: str
    since: float


class EndedRequests:
    """The last `capacity` request ids that finished or were aborted, with how they ended."""

    def __init__(self, capacity: int = ENDED_MEMORY) -> None:
        self._capacity = capacity
        self._ended: OrderedDict[str, str] = OrderedDict()

    def note(self, request_id: str, how: str) -> None:
        self._ended[request_id] = how
        self._ended.move_to_end(request_id)
        while len(self._ended) > self._capacity:
            self._ended.popitem(last=False)

    def get(self, request_id: str) -> str | None:
        return self._ended.get(request_id)

    def last(self, count: int) -> dict[str, str]:
        """The `count` requests that ended last, oldest first, with how they ended."""
        return dict(list(self._ended.items())[-count:]) if count > 0 else {}


class RequestHolds(Scheduler):
    """vLLM's scheduler with public pause, park and resume of one request by its vLLM id
    (the internal `cmpl-<X-Request-Id>-<n>-<random>`; kvwatch_vllm.ids maps to it).

    Invariants: a held request is in `requests` and in no queue; a paused one holds its
    blocks and one running slot (`max_num_active_reqs` is lowered by the number paused); a
    parked one holds no blocks; an ended request is never held (holds are dropped when their
    request finishes or is aborted, whatever the hold). Each method returns a `HoldResult`
    and never raises for any id: unknown, ended, aborted and transfer-pending ids get their
    status.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._holds: dict[str, Hold] = {}
        self._ended = EndedRequests()
        self._active_limit = self.max_num_active_reqs
        self.bytes_per_block = bytes_per_block(self.kv_cache_config)

    # ---- the public commands ----

    def pause_request(self, request_id: str) -> HoldResult:
        """Stop scheduling the request; it keeps its KV blocks and its running slot. A parked
        request stays parked (answered paused: the agent renews a hold's lease with a pause)."""
        return self._guarded(PAUSE, request_id, self._pause)

    def park_request(self, request_id: str) -> HoldResult:
        """Free the request's KV blocks now and keep it out of scheduling until resumed."""
        return self._guarded(PARK, request_id, self._park)

    def resume_request(self, request_id: str) -> HoldResult:
        """Let a paused or parked request run again, ahead of the requests waiting."""
        return self._guarded(RESUME, request_id, self._resume)

    def held_requests(self) -> dict[str, str]:
        """Each held request's vLLM id and state ("paused" or "parked")."""
        return {request_id: hold.state for request_id, hold in self._holds.items()}

    def recently_ended(self, count: int) -> dict[str, str]:
        """The vLLM ids of the `count` requests that ended last and how each ended, e.g.
        "finished (length)" or "ended (FINISHED_ABORTED)" (an abort: a cancel, a client gone)."""
        return self._ended.last(count)

    def free_block_count(self) -> int:
        """Blocks in vLLM's free pool now (cached-but-free blocks included)."""
        return int(self.kv_cache_manager.block_pool.get_num_free_blocks())

    def request_block_count(self, request_id: str) -> int:
        """Distinct KV blocks the request holds now (0 when it holds none)."""
        return len(self._blocks_of(request_id))

    # ---- vLLM's hooks this class extends ----

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None:
                    self._ended.note(output.request_id, f"finished ({output.finish_reason})")
        self._drop_ended_holds()
        return outputs

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._ended.note(request.request_id, f"ended ({finished_status.name})")
        self._drop_ended_holds()
        return finished

    def has_finished_requests(self) -> bool:
        """As vLLM's, but a held request is not taken for one whose connector free is
        pending (vLLM counts requests in no queue as such), or the engine loop would spin
        while a request is held."""
        if self.finished_req_ids:
            return True
        if self.connector is None:
            return False
        num_running, num_waiting = self.get_request_counts()
        return len(self.requests) > num_running + num_waiting + len(self._holds)

    # ---- the commands' bodies; each runs with the request found and alive ----

    def _pause(self, request: Request) -> HoldResult:
        request_id = request.request_id
        hold = self._holds.get(request_id)
        if hold is not None and hold.state == PAUSED:
            return HoldResult(request_id, PAUSE, PAUSED, detail="already paused")
        if hold is not None:  # the agent renews a park's lease with a pause (docs/protocol.md)
            return HoldResult(request_id, PAUSE, PAUSED, detail="parked: it stays parked")
        if request.status != RequestStatus.RUNNING or request not in self.running:
            return HoldResult(
                request_id,
                PAUSE,
                DECLINED,
                detail=f"not running ({request.status.name}): it is not scheduled yet and "
                "holds no KV to keep; park it to keep it out of scheduling",
            )
        self.running.remove(request)
        self._hold(request, PAUSED)
        in_flight = request.num_output_placeholders
        detail = f"{in_flight} token(s) already in flight still arrive" if in_flight else ""
        return HoldResult(request_id, PAUSE, PAUSED, detail=detail)

    def _park(self, request: Request) -> HoldResult:
        request_id = request.request_id
        hold = self._holds.get(request_id)
        if hold is not None and hold.state == PARKED:
            return HoldResult(request_id, PARK, PARKED, detail="already parked")
        transfer = pending_transfer(self, request)
        if transfer is not None:
            return HoldResult(request_id, PARK, DECLINED, detail=f"KV transfer pending: {transfer}")
        if hold is not None or request in self.running:
            return self._park_running(request)
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            if self.request_block_count(request_id) > 0:
                return HoldResult(
                    request_id,
                    PARK,
                    DECLINED,
                    detail=f"waiting ({request.status.name}) with KV blocks already "
                    "allocated: not parked",
                )
            self._remove_from_waiting(request)
            self._hold(request, PARKED)
            return HoldResult(
                request_id, PARK, PARKED, detail=f"was waiting ({request.status.name}): held no KV"
            )
        return HoldResult(
            request_id, PARK, DECLINED, detail=f"cannot park a request in {request.status.name}"
        )

    def _park_running(self, request: Request) -> HoldResult:
        """Frees a running or paused request's blocks through vLLM's preemption."""
        request_id = request.request_id
        blocks = self._blocks_of(request_id)
        shared = sum(1 for block in blocks if block.ref_cnt > 1)
        free_before = self.free_block_count()
        if request in self.running:
            self.running.remove(request)
        self._holds.pop(request_id, None)  # a paused one: its slot goes with its blocks
        self._apply_active_limit()
        self._preempt_request(
            request, time.monotonic(), drop_stale_output=self.requires_kv_delivery
        )
        self._remove_from_waiting(request)  # preemption queued it; the park holds it
        self._hold(request, PARKED)
        freed_now = self.free_block_count() - free_before
        # With overlapping batches and a KV-consuming connector vLLM returns blocks a step in
        # flight may still write only after that step (its deferred frees): freed all the same.
        deferred = max(0, len(blocks) - shared - freed_now)
        freed = freed_now + deferred
        detail = f"freed {freed} of its {len(blocks)} blocks"
        if shared:
            detail += f"; {shared} shared with other requests (prefix cache) stay"
        if deferred:
            detail += f"; {deferred} of them return to the pool when the step in flight ends"
        return HoldResult(
            request_id,
            PARK,
            PARKED,
            freed_blocks=freed,
            freed_bytes=freed * self.bytes_per_block,
            detail=detail,
        )

    def _resume(self, request: Request) -> HoldResult:
        request_id = request.request_id
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return HoldResult(
                request_id,
                RESUME,
                NOT_HELD,
                detail=f"neither paused nor parked ({request.status.name})",
            )
        held_for = time.monotonic() - hold.since
        if hold.state == PAUSED:
            self.running.insert(0, request)  # its slot was kept: there is room
            self._apply_active_limit()
            return HoldResult(
                request_id, RESUME, RESUMED, detail=f"paused {held_for:.3f} s; kept its blocks"
            )
        self.waiting.prepend_request(request)
        return HoldResult(
            request_id,
            RESUME,
            RESUMED,
            detail=f"parked {held_for:.3f} s; re-admitted at the head of the waiting queue",
        )

    # ---- helpers ----

    def _guarded(self, command: str, request_id: str, body: Any) -> HoldResult:
        """Finds the request and runs `body`, answering for every id, never raising."""
        try:
            request = self.requests.get(request_id)
            if request is None:
                how = self._ended.get(request_id)
                if how is not None:
                    return HoldResult(request_id, command, ALREADY_FINISHED, detail=how)
                return HoldResult(
                    request_id, command, UNKNOWN_REQUEST, detail="no such request in this engine"
                )
            if request.is_finished():
                return HoldResult(
                    request_id,
                    command,
                    ALREADY_FINISHED,
                    detail=f"ended ({request.status.name}); its blocks wait for a KV transfer",
                )
            result: HoldResult = body(request)
            return result
        except Exception as exc:  # a bug here must not take the engine core down
            return HoldResult(request_id, command, FAILED, detail=f"{type(exc).__name__}: {exc}")

    def _hold(self, request: Request, state: str) -> None:
        self._holds[request.request_id] = Hold(request, state, time.monotonic())
        self._apply_active_limit()

    def _apply_active_limit(self) -> None:
        """A paused request keeps its running slot: admission leaves room for it."""
        paused = sum(1 for hold in self._holds.values() if hold.state == PAUSED)
        self.max_num_active_reqs = max(0, self._active_limit - paused)

    def _drop_ended_holds(self) -> None:
        ended = [
            request_id
            for request_id, hold in self._holds.items()
            if hold.request.is_finished() or request_id not in self.requests
        ]
        for request_id in ended:
            del self._holds[request_id]
        if ended:
            self._apply_active_limit()

    def _remove_from_waiting(self, request: Request) -> None:
        self.waiting.remove_requests((request,))
        self.kv_holding_waiting.remove_requests((request,))
        self.deferred_waiting.discard(request)

    def _blocks_of(self, request_id: str) -> list[Any]:
        """The request's distinct real blocks (the null block of sliding windows left out)."""
        if request_id not in self.requests:
            return []
        seen: dict[int, Any] = {}
        for group in self.kv_cache_manager.get_blocks(request_id).blocks:
            for block in group:
                if not block.is_null:
                    seen[block.block_id] = block
        return list(seen.values())


def bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """KV bytes one block id holds: its page in each layer of its group (the largest group's,
    when a model has several)."""
    sizes = [
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    ]
    return max(sizes, default=0)
