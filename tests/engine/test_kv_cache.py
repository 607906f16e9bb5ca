"""Block pool and scheduler bookkeeping under random operation sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvwatch.lab.engine.kv_cache import BlockPool, KvCacheInvariantError, KVCacheManager
from kvwatch.lab.engine.scheduler import Scheduler, SeqStatus, Sequence

NUM_BLOCKS = 24
BLOCK_SIZE = 4


def test_exhaustion_is_an_expected_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) is None
    assert pool.num_free == 1
    pool.check()


def test_freeing_a_block_one_does_not_own_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate("a", 2)
    assert blocks is not None
    with pytest.raises(KvCacheInvariantError):
        pool.free("b", blocks)
    pool.free("a", blocks)
    with pytest.raises(KvCacheInvariantError):
        pool.free("a", blocks)  # a double free is a bug, not a no-op
    pool.check()


class BlockTables(RuleBasedStateMachine):
    """allocate / append / free / preempt / cancel on a KV manager, straight."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[str, int] = {}
        self.counter = 0

    @rule(target=requests, num_tokens=st.integers(1, 40))
    def allocate(self, num_tokens: int) -> str:
        self.counter += 1
        request_id = f"r{self.counter}"
        free_before = self.kv.num_free_blocks
        if self.kv.ensure_capacity(request_id, num_tokens):
            self.tokens[request_id] = num_tokens
        else:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.num_blocks_of(request_id) == 0
        return request_id

    @rule(request_id=requests, more=st.integers(1, 9))
    def append(self, request_id: str, more: int) -> None:
        if request_id not in self.tokens:
            return
        before = self.kv.block_table(request_id)
        if self.kv.ensure_capacity(request_id, self.tokens[request_id] + more):
            self.tokens[request_id] += more
            assert self.kv.block_table(request_id)[: len(before)] == before
        else:
            assert self.kv.block_table(request_id) == before

    @rule(request_id=consumes(requests))
    def free(self, request_id: str) -> None:
        expected = self.kv.num_blocks_of(request_id)
        assert self.kv.free(request_id) == expected
        self.tokens.pop(request_id, None)

    @rule(request_id=requests)
    def preempt(self, request_id: str) -> None:
        """Free now, recompute later: the same id comes back with its tokens."""
        tokens = self.tokens.pop(request_id, None)
        self.kv.free(request_id)
        if tokens is not None and self.kv.ensure_capacity(request_id, tokens):
            self.tokens[request_id] = tokens

    @invariant()
    def blocks_owned_once_and_conserved(self) -> None:
        self.kv.check_invariants()
        owned = sum(self.kv.num_blocks_of(r) for r in self.tokens)
        assert owned + self.kv.num_free_blocks == NUM_BLOCKS
        for request_id, tokens in self.tokens.items():
            assert self.kv.num_blocks_of(request_id) == self.kv.blocks_needed(tokens)


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler driving the KV manager: admissions, steps, preemptions, cancels, clients
    that stop reading (egress-blocked requests keep their blocks) and pauses (a paused request
    is neither advanced, admitted nor preempted)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.blocked: set[str] = set()
        self.scheduler = Scheduler(
            self.kv, max_running=6, max_prefill_tokens=48, is_egress_blocked=self._blocked
        )
        self.live: list[Sequence] = []
        self.counter = 0

    def _blocked(self, seq: Sequence) -> bool:
        return seq.request_id in self.blocked

    @rule(prompt=st.integers(1, 30), max_tokens=st.integers(1, 30))
    def submit(self, prompt: int, max_tokens: int) -> None:
        if self.kv.blocks_needed(prompt + max_tokens) > NUM_BLOCKS:
            return  # the engine rejects these at submit
        self.counter += 1
        seq = Sequence(f"s{self.counter}", [1] * prompt, prompt, max_tokens)
        self.scheduler.add(seq)
        self.live.append(seq)

    @rule()
    def step(self) -> None:
        plan = self.scheduler.schedule()
        for seq in plan.prefills + plan.decodes:
            assert seq.status is SeqStatus.RUNNING
            assert not seq.paused
            assert self.kv.num_blocks_of(seq.request_id) >= self.kv.blocks_needed(
                len(seq.token_ids)
            )
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(2)
            if seq.num_generated >= seq.max_tokens:
                self.scheduler.remove(seq)
                self.live.remove(seq)
        for seq in plan.preempted:
            assert self.kv.num_blocks_of(seq.request_id) == 0
            assert not seq.paused

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.scheduler.remove(seq)
        self.live.remove(seq)
        assert self.kv.num_blocks_of(seq.request_id) == 0

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def toggle_reader(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.live)).request_id
        self.blocked ^= {request_id}

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def toggle_pause(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        seq.paused = not seq.paused

    @invariant()
    def ownership(self) -> None:
        self.kv.check_invariants()
        owned = 0
        for seq in self.live:
            blocks = self.kv.num_blocks_of(seq.request_id)
            owned += blocks
            if seq.status is SeqStatus.WAITING:
                assert blocks == 0
        assert owned + self.kv.num_free_blocks == NUM_BLOCKS
        assert len(self.scheduler.waiting) + len(self.scheduler.running) == len(self.live)


TestBlockTables = BlockTables.TestCase
TestBlockTables.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
