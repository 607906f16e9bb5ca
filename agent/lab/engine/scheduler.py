"""Iteration-level scheduling: which requests run in the next model step.

Each step the scheduler (1) reserves one more KV slot for every running request that may advance,
preempting the newest running requests when the pool runs out, then (2) admits waiting requests
first-come first-served while their prompt fits in the free blocks. Preemption frees a request's
blocks and puts it back at the head of the queue; it is recomputed from its tokens later.
A paused request is skipped by both: it keeps its blocks (if it has any) and its place.
Parking takes a request out of both (its blocks are freed once their copy to host memory is
done, kvwatch.lab.engine.parking); resuming puts it at the head of the queue, and the engine copies
its KV back in once admitted.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwatch.lab.engine.kv_cache import KVCacheManager


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress. Owned by the engine thread.

    `token_ids` holds the prompt then every generated token; the KV of the first
    `num_computed_tokens` of them is in the cache, except for a parked request and a resumed
    one not yet admitted again: their KV is in the engine's host copy (`ParkingLot`) until
    admission gives them blocks and the engine copies it back, before their next step. A
    running request between steps has exactly one uncomputed token: the last one it generated.
    `paused`: the agent paused it; the scheduler neither advances nor admits it.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    paused: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass
class StepPlan:
    """What one model step computes: `prefills` (several uncomputed tokens each: new or
    recomputed requests) and `decodes` (one token each); `preempted` lost their blocks."""

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Waiting queue and running set over one `KVCacheManager`.

    Invariants: a sequence is in at most one of `waiting` and `running`, and its status says
    which (a parked one is in neither); waiting sequences own no blocks, nor do parked ones
    once their copy is done; after `schedule`, every planned sequence's block table covers all
    its tokens. A request blocked on egress (its client is not reading, in coupled mode) or
    paused is neither advanced nor chosen as a preemption victim: it keeps its blocks, unless
    the engine parks it; waiting, it is not admitted (it could not advance) but keeps its place
    in the queue while the ones behind it are admitted.

    Ownership: the engine thread alone calls every method.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_running: int,
        max_prefill_tokens: int,
        is_egress_blocked: Callable[[Sequence], bool],
    ) -> None:
        self.kv = kv
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.is_egress_blocked = is_egress_blocked
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> int:
        """Takes the sequence out of scheduling and frees its blocks; returns how many.

        The caller must have waited for device work on those blocks to complete."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        return self.kv.free(seq.request_id)

    def park(self, seq: Sequence) -> None:
        """Takes a running sequence out of scheduling (it keeps `num_computed_tokens`, and
        its blocks until the caller frees them: once their copy to host memory is done)."""
        self.running.remove(seq)
        seq.status = SeqStatus.PARKED
        seq.paused = False

    def resume(self, seq: Sequence) -> None:
        """Puts a parked sequence at the head of the queue, ahead of new work."""
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or self._stays(seq):
                continue
            if self._reserve(seq, plan):
                (plan.decodes if seq.num_uncomputed == 1 else plan.prefills).append(seq)
        if not plan.preempted:
            self._admit(plan)
        return plan

    def _reserve(self, seq: Sequence, plan: StepPlan) -> bool:
        """Makes room for the sequence's tokens, preempting newer requests; False if the
        sequence itself had to be preempted."""
        while not self.kv.ensure_capacity(seq.request_id, len(seq.token_ids)):
            victim = next(s for s in reversed(self.running) if not self._stays(s))
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _stays(self, seq: Sequence) -> bool:
        """A request that stays where it is: running, it neither advances nor gives its
        blocks up; waiting, it is not admitted. Paused, or waiting for its client."""
        return seq.paused or self.is_egress_blocked(seq)

    def _admit(self, plan: StepPlan) -> None:
        budget = self.max_prefill_tokens
        for seq in list(self.waiting):  # a copy: admitting removes from the queue
            if len(self.running) >= self.max_running:
                return
            if self._stays(seq):
                continue
            if plan.prefills and seq.num_uncomputed > budget:
                return
            if not self.kv.ensure_capacity(seq.request_id, len(seq.token_ids)):
                return
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.prefills.append(seq)
            budget -= seq.num_uncomputed
