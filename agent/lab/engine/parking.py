"""Parking: a request gives its KV blocks back and keeps its place, its connection and its
output; once released it runs on exactly where it stopped.

On park the contents of the request's blocks are copied to host memory; the blocks return to
the pool once that copy has completed (on CUDA it runs on a stream of its own, so the engine
steps on meanwhile: kvwatch.lab.engine.transfer), and only then is the park answered. On release
the request goes to the head of the queue and, once admitted into fresh blocks, its KV is
copied back before its next step. The copy is exact: the request continues with the very
numbers it computed. Recomputing the context instead (as preemption does) keeps no host memory
but is not: bench/bench_park.py found recomputed KV off by up to 4e-4 in float32 and 0.27 in
bfloat16, where it changed the tokens of 16 of 100 runs (none of 100 in float32); and a resume
cost a prefill of the context (85 ms at 512 tokens, 673 ms at 2048 on the default model on a
shared CPU) against a copy of 1.9 and 8.8 ms. Sampling is untouched: no step runs for a parked
request, so its generator draws nothing.

A park no longer waits for the request's writer to be held by its client: the agent parks
from the reader's unread backlog (with default socket buffers a writer never blocks), and a
parked request runs again only when released, by the agent or by the engine hook when the
agent's lease runs out (kvwatch.hook.holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.engine.attention import PagedKVStorage
from kvwatch.lab.engine.kv_cache import KvCacheInvariantError
from kvwatch.lab.engine.orders import ParkOrder, failed
from kvwatch.lab.engine.requests import LiveRequest
from kvwatch.lab.engine.scheduler import Scheduler, SeqStatus, Sequence
from kvwatch.lab.engine.transfer import HostKV

_BUG_HINT = "this is a bug in the reference engine; report it with the engine log"

# How a park copies a request's blocks out to host memory: `PagedKVStorage.copy_out`, or a
# test's stand-in (a slow asynchronous copy).
CopyOut = Callable[[PagedKVStorage, list[int]], HostKV]


@dataclass(frozen=True)
class _Copying:
    """A park whose copy to host memory is under way: the request still owns its blocks."""

    live: LiveRequest
    order: ParkOrder


class ParkingLot:
    """Parked requests and their KV copies in host memory.

    Ownership: the engine thread alone calls every method, at step boundaries.
    Invariants: a parked request (`_parked`) is PARKED in the scheduler and has a host copy;
    a request with a host copy is parked, or released and waiting for admission; it owns
    blocks only while its copy is under way (`_copying`, parked requests),
    and those blocks return to the pool only once the copy is done; `host_bytes` is the sum of
    the copies (those under way included) and stays within `host_limit_bytes`; every park is
    answered exactly once: "parked" once its blocks are free, or "failed" (`abandon`).
    """

    def __init__(
        self,
        storage: PagedKVStorage,
        scheduler: Scheduler,
        host_limit_bytes: int,
        copy_out: CopyOut | None = None,
    ) -> None:
        self._storage = storage
        self._scheduler = scheduler
        self._kv = scheduler.kv
        self._copy_out = copy_out or PagedKVStorage.copy_out
        self.host_limit_bytes = host_limit_bytes
        self._parked: dict[str, LiveRequest] = {}
        self._copies: dict[str, HostKV] = {}
        self._copying: dict[str, _Copying] = {}
        self.host_bytes = 0
        self.num_parks = 0
        self.num_resumes = 0

    @property
    def num_parked(self) -> int:
        """Requests parked now (copies under way included)."""
        return len(self._parked)

    @property
    def copying(self) -> bool:
        """Whether a park's copy is under way (the engine then looks again soon)."""
        return bool(self._copying)

    def is_copying(self, request_id: str) -> bool:
        return request_id in self._copying

    def refusal(self, live: LiveRequest) -> str | None:
        """Why the request cannot be parked now (the park is declined), or None."""
        seq = live.seq
        if seq.status is SeqStatus.PARKED:
            return "it is already parked"
        blocks = self._kv.num_blocks_of(seq.request_id)
        if seq.status is not SeqStatus.RUNNING or blocks == 0:
            return "it holds no KV blocks: it is waiting for admission"
        needed = blocks * self._storage.bytes_per_block
        if self.host_bytes + needed > self.host_limit_bytes:
            return (
                f"parked requests hold {self.host_bytes} bytes of host memory; {needed} more "
                f"would pass the {self.host_limit_bytes}-byte limit"
            )
        return None

    def park(self, live: LiveRequest, order: ParkOrder) -> None:
        """Starts copying the request's blocks to host memory and takes it out of scheduling;
        `settle` frees the blocks and answers `order` once the copy is done. The caller saw
        no `refusal`."""
        seq = live.seq
        copy = self._copy_out(self._storage, self._kv.block_table(seq.request_id))
        self._scheduler.park(seq)
        self._parked[seq.request_id] = live
        self._copies[seq.request_id] = copy
        self.host_bytes += copy.num_bytes
        self._copying[seq.request_id] = _Copying(live, order)

    def settle(self, wait_for: str | None = None) -> list[LiveRequest]:
        """Frees the blocks of every park whose copy is done (waiting for the copy of
        `wait_for`, if it is under way) and answers it; returns those requests."""
        settled: list[LiveRequest] = []
        for request_id, copying in list(self._copying.items()):
            transfer = self._copies[request_id].transfer
            if request_id == wait_for:
                transfer.wait()
            if not transfer.done():
                continue
            del self._copying[request_id]
            freed = self._kv.free(request_id)
            freed_bytes = freed * self._storage.bytes_per_block
            self.num_parks += 1
            copying.order.outcome.set_result(
                CommandOutcome(request_id, "parked", freed, freed_bytes)
            )
            settled.append(copying.live)
        return settled

    def release(self, live: LiveRequest) -> None:
        """Sends a parked request to the head of the queue, its copy done first (`settle`)."""
        request_id = live.seq.request_id
        self.settle(wait_for=request_id)
        del self._parked[request_id]
        self._scheduler.resume(live.seq)

    def restore(self, admitted: list[Sequence]) -> list[Sequence]:
        """Copies the KV of the released requests among those just admitted back into their
        new blocks; returns those requests."""
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
        """Drops what is kept for a request that ends: its host copy (after its copy is
        done and its park answered: its blocks are free then)."""
        self.settle(wait_for=request_id)
        self._parked.pop(request_id, None)
        copy = self._copies.pop(request_id, None)
        if copy is not None:
            self.host_bytes -= copy.num_bytes

    def abandon(self, detail: str) -> None:
        """The engine failed: answers every park under way `failed`, touching no block."""
        for request_id, copying in self._copying.items():
            copying.order.outcome.set_result(failed(request_id, detail))
        self._copying.clear()

    def check_invariants(self) -> None:
        """Raises `KvCacheInvariantError` if an invariant of the class docstring is broken."""
        for request_id, live in self._parked.items():
            if live.seq.status is not SeqStatus.PARKED or request_id not in self._copies:
                raise KvCacheInvariantError(f"{request_id!r} is parked without a copy", _BUG_HINT)
        if not self._copying.keys() <= self._parked.keys():
            raise KvCacheInvariantError("a request is copied out but not parked", _BUG_HINT)
        for request_id in self._copies:
            if request_id not in self._copying and self._kv.num_blocks_of(request_id):
                raise KvCacheInvariantError(
                    f"{request_id!r} owns blocks and a host copy", _BUG_HINT
                )
        if self.host_bytes != sum(copy.num_bytes for copy in self._copies.values()):
            raise KvCacheInvariantError("host bytes of parked KV miscounted", _BUG_HINT)
        if self.host_bytes > self.host_limit_bytes:
            raise KvCacheInvariantError("parked KV is over its host limit", _BUG_HINT)
