"""Parking: a request whose client is not reading gives its KV blocks back and keeps its place;
once its client has read again (its writer's send went through) it runs on exactly where it
stopped.

On park the contents of the request's blocks are copied to host memory and the blocks return to
the pool; on resume the request goes to the head of the queue and, once admitted into fresh
blocks, its KV is copied back before its next step. The copy is exact: the request continues
with the very numbers it computed. Recomputing the context instead (as preemption does) keeps
no host memory but is not: bench/bench_park.py found recomputed KV off by up to 4e-4 in
float32 and 0.27 in bfloat16, where it changed the tokens of 9 of 100 runs (none of 100 in
float32); and a resume cost a prefill of the context (62 ms at 512 tokens, 448 ms at 2048 on
the default model on a CPU) against a copy of 0.8 and 1.6 ms. Sampling is untouched: no step
runs for a parked request, so its generator draws nothing.

A resumed request's output queue is widened to hold the rest of its generation, drawn from one
budget per engine, so a slow reader is parked once: its request then runs to its end at engine
speed, frees its blocks there, and a later park finds it not held by its client. A park is
accepted once the request's writer has been held in a send for HELD_SECONDS: under a client
that stopped reading, the server's own write buffer fills a moment after the socket's, and a
park that comes before is declined (the agent asks again).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from kvwatch.engine.attention import PagedKVStorage
from kvwatch.engine.kv_cache import KvCacheInvariantError
from kvwatch.engine.output import OutputChannel
from kvwatch.engine.requests import LiveRequest
from kvwatch.engine.scheduler import Scheduler, SeqStatus, Sequence

_BUG_HINT = "this is a bug in the reference engine; report it with the engine log"
# A writer away this long with its last batch is held in a send by its client: a writer that
# is not comes back for more within a step or two.
HELD_SECONDS = 0.25


@dataclass(frozen=True)
class _HostCopy:
    """One parked request's KV blocks in host memory (`PagedKVStorage.copy_out`)."""

    blocks: torch.Tensor
    num_bytes: int


@dataclass(frozen=True)
class _Grant:
    """Tokens a resumed request's output queue may hold beyond the coupled queue. Held while
    those tokens may still be in host memory: until its queue is spent or gone."""

    channel: weakref.ref[OutputChannel]
    tokens: int


class ParkingLot:
    """Parked requests, their KV copies in host memory, and the output grants of resumed ones.

    Ownership: the engine thread alone calls every method, at step boundaries, and frees a
    request's blocks here only after waiting for the device fence.
    Invariants: a parked request is PARKED in the scheduler and owns no blocks; a request with
    a host copy is parked, or resumed and waiting for admission (owning no blocks either);
    `host_bytes` is the sum of the copies and stays within `host_limit_bytes`; the granted
    tokens stay within `resume_buffer_tokens`.
    """

    def __init__(
        self,
        storage: PagedKVStorage,
        scheduler: Scheduler,
        host_limit_bytes: int,
        resume_buffer_tokens: int,
    ) -> None:
        self._storage = storage
        self._scheduler = scheduler
        self._kv = scheduler.kv
        self.host_limit_bytes = host_limit_bytes
        self.resume_buffer_tokens = resume_buffer_tokens
        self._parked: dict[str, LiveRequest] = {}  # waiting on their client, oldest first
        self._taken_at_park: dict[str, int] = {}  # their writers' batches taken when parked
        self._copies: dict[str, _HostCopy] = {}
        self._grants: list[_Grant] = []
        self.host_bytes = 0
        self.num_parks = 0
        self.num_resumes = 0

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def granted_tokens(self) -> int:
        return sum(grant.tokens for grant in self._grants)

    def refusal(self, live: LiveRequest) -> str | None:
        """Why the request cannot be parked now (the park is declined), or None."""
        seq = live.seq
        if seq.status is SeqStatus.PARKED:
            return "it is already parked"
        blocks = self._kv.num_blocks_of(seq.request_id)
        if seq.status is not SeqStatus.RUNNING or blocks == 0:
            return "it holds no KV blocks: it is waiting for admission"
        channel = live.handle.channel
        if channel.capacity - channel.unread >= seq.max_tokens - seq.num_generated:
            return "it is not held by its client: its output queue holds the rest of its answer"
        held = channel.held_seconds(time.monotonic_ns())
        if held < HELD_SECONDS:
            return (
                f"it is not waiting on its client: its writer is not held in a send "
                f"(it took output {held * 1000:.0f} ms ago)"
            )
        needed = blocks * self._storage.bytes_per_block
        if self.host_bytes + needed > self.host_limit_bytes:
            return (
                f"parked requests hold {self.host_bytes} bytes of host memory; {needed} more "
                f"would pass the {self.host_limit_bytes}-byte limit"
            )
        return None

    def park(self, live: LiveRequest) -> int:
        """Copies the request's blocks to host memory, frees them and parks it; returns how
        many blocks it freed. The caller saw no `refusal` and waited for the device fence."""
        request_id = live.seq.request_id
        blocks = self._storage.copy_out(self._kv.block_table(request_id))
        freed = self._scheduler.park(live.seq)
        copy = _HostCopy(blocks, freed * self._storage.bytes_per_block)
        self._copies[request_id] = copy
        self.host_bytes += copy.num_bytes
        self._parked[request_id] = live
        self._taken_at_park[request_id] = live.handle.channel.batches_taken
        self.num_parks += 1
        return freed

    def resume_ready(self) -> None:
        """Sends each parked request whose client read again (its writer's send went through:
        it took another batch, or waits for output) to the head of the queue (the longest
        parked first) and widens its output queue."""
        now_ns = time.monotonic_ns()
        ready = [
            live
            for request_id, live in self._parked.items()
            if live.handle.channel.batches_taken > self._taken_at_park[request_id]
            or not live.handle.channel.held_seconds(now_ns)
        ]
        for live in reversed(ready):  # each goes in front: the first parked ends up first
            del self._parked[live.seq.request_id]
            del self._taken_at_park[live.seq.request_id]
            self._scheduler.resume(live.seq)
            self._widen(live)

    def restore(self, admitted: list[Sequence]) -> list[Sequence]:
        """Copies the KV of the resumed requests among those just admitted back into their new
        blocks; returns those requests."""
        restored: list[Sequence] = []
        for seq in admitted:
            copy = self._copies.pop(seq.request_id, None)
            if copy is None:
                continue
            self._storage.copy_in(self._kv.block_table(seq.request_id), copy.blocks)
            self.host_bytes -= copy.num_bytes
            self.num_resumes += 1
            restored.append(seq)
        return restored

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a request that ended: its parked place and its host copy."""
        self._parked.pop(request_id, None)
        self._taken_at_park.pop(request_id, None)
        copy = self._copies.pop(request_id, None)
        if copy is not None:
            self.host_bytes -= copy.num_bytes

    def release_spent_grants(self) -> None:
        """Gives back the grants whose output queues are spent (finished and read) or gone."""
        self._grants = [
            grant
            for grant in self._grants
            if (channel := grant.channel()) is not None and not channel.is_spent()
        ]

    def _widen(self, live: LiveRequest) -> None:
        seq, channel = live.seq, live.handle.channel
        available = self.resume_buffer_tokens - self.granted_tokens
        grant = min(seq.max_tokens - seq.num_generated, available)
        if grant > 0:
            channel.raise_capacity(channel.capacity + grant)
            self._grants.append(_Grant(weakref.ref(channel), grant))

    def check_invariants(self) -> None:
        """Raises `KvCacheInvariantError` if an invariant of the class docstring is broken."""
        for request_id, live in self._parked.items():
            if live.seq.status is not SeqStatus.PARKED or request_id not in self._copies:
                raise KvCacheInvariantError(f"{request_id!r} is parked without a copy", _BUG_HINT)
        for request_id in self._copies:
            if self._kv.num_blocks_of(request_id):
                raise KvCacheInvariantError(
                    f"{request_id!r} owns blocks and a host copy", _BUG_HINT
                )
        if self.host_bytes != sum(copy.num_bytes for copy in self._copies.values()):
            raise KvCacheInvariantError("host bytes of parked KV miscounted", _BUG_HINT)
