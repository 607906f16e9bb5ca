"""A park whose copy to host memory is slow and asynchronous (issue 38, item 3): the engine
never frees KV that a copy still reads. The test's copy starts only when the test opens its
gate, on a thread of its own, as a copy on a CUDA stream runs beside the engine, and reads the
blocks then: a block handed to another request before the copy completed would change the
parked request's KV, and so its output after the release.

While the copy is under way the engine steps on: a cancel of another request is answered,
and a new request that needs blocks gets only free ones, never the parked request's; a cancel
of the parked request itself waits for the copy. Once the copy completes, the blocks return to
the pool and the park is answered; released, the request's output is the unparked one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.engine.attention import PagedKVStorage
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.transfer import HostKV, KVTransfer
from kvwatch.lab.waiting import wait_until
from tests.engine.readers import Reader, assert_all_free, state_of, submit, wait_state

pytestmark = pytest.mark.engine

WAIT_SECONDS = 20.0
POOL_BLOCKS = 6  # block ids 0..5, handed out in order; freed ones go to the back
PARKED_PROMPT = "p" * 40  # 41 tokens with BOS, 45 once blocked on its reader: 3 blocks
OTHER_PROMPT = "b" * 40  # needs 3 blocks to be admitted


class GatedTransfer(KVTransfer):
    """Done once the copy thread ran; `waiting` is set when the engine waits for it."""

    def __init__(self) -> None:
        self.copied = threading.Event()
        self.waiting = threading.Event()

    def done(self) -> bool:
        return self.copied.is_set()

    def wait(self) -> None:
        self.waiting.set()
        assert self.copied.wait(WAIT_SECONDS), "the test never opened the copy's gate"


class SlowCopy:
    """`Engine(copy_out=...)`: each copy reads its blocks only once `gate` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.block_ids: list[int] = []
        self.transfer = GatedTransfer()

    def __call__(self, storage: PagedKVStorage, block_ids: list[int]) -> HostKV:
        self.block_ids = list(block_ids)
        keys = storage.keys[0]
        size = (len(storage.keys), 2, len(block_ids), storage.block_size, *keys.shape[1:])
        host = torch.empty(size, dtype=keys.dtype)

        def copy() -> None:
            self.gate.wait(WAIT_SECONDS)
            host.copy_(storage.copy_out(self.block_ids).blocks)
            self.transfer.copied.set()

        threading.Thread(target=copy, name="test-slow-copy", daemon=True).start()
        return HostKV(host, self.transfer)


@pytest.fixture
def slow(make_engine: Callable[..., Engine]) -> Iterator[SlowCopy]:
    """A slow copy whose gate opens at the latest when the test ends (before its engine
    stops: stopping waits for the copies under way)."""
    copy = SlowCopy()
    yield copy
    copy.gate.set()


@pytest.fixture
def commands() -> Iterator[ThreadPoolExecutor]:
    """Engine commands block until answered: the test sends them from these threads."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def start_park(
    engine: Engine, reader: Reader, commands: ThreadPoolExecutor
) -> Future[CommandOutcome]:
    wait_state(engine, reader, "egress_blocked")
    parking = commands.submit(engine.park, reader.request_id, "test")
    wait_state(engine, reader, "parking")
    return parking


def test_blocks_under_a_park_copy_are_never_handed_out_and_nothing_is_lost(
    make_engine: Callable[..., Engine], slow: SlowCopy, commands: ThreadPoolExecutor
) -> None:
    expected = submit(make_engine(kv_blocks=POOL_BLOCKS), PARKED_PROMPT, 40).read_all()
    engine = make_engine(copy_out=slow, kv_blocks=POOL_BLOCKS, debug_checks=True)
    parked = submit(engine, PARKED_PROMPT, 40)  # blocks 0, 1, 2
    small = submit(engine, "c", 40)  # block 3; blocks 4 and 5 are free
    wait_state(engine, small, "egress_blocked")
    parking = start_park(engine, parked, commands)
    assert slow.block_ids == [0, 1, 2]

    newcomer = submit(engine, OTHER_PROMPT, 8)  # 3 blocks: it must wait for the park's
    time.sleep(0.3)  # deliberate: nothing may be handed out while the copy runs
    assert state_of(engine, newcomer.request_id) == "waiting"
    cancelled = engine.cancel(small.request_id, "test")  # answered while the copy runs
    assert (cancelled.status, cancelled.freed_blocks) == ("cancelled", 1)
    wait_state(engine, newcomer, "egress_blocked")  # in blocks 4, 5 and 3
    assert engine.stats().kv_blocks_used == POOL_BLOCKS  # the parked request's 3 too
    assert not parking.done() and not slow.transfer.copied.is_set()

    slow.gate.set()
    outcome = parking.result(WAIT_SECONDS)
    assert (outcome.status, outcome.freed_blocks) == ("parked", 3)
    newcomer.read_all()
    parked.read_queued()
    assert engine.release(parked.request_id, "test").status == "released"
    parked.read_all()

    assert (parked.token_ids, parked.text) == (expected.token_ids, expected.text)
    assert [recomputed for _blocks, recomputed in parked.resumes] == [0]
    assert_all_free(engine)


def test_a_cancel_during_a_park_copy_frees_the_blocks_only_once_it_completed(
    make_engine: Callable[..., Engine], slow: SlowCopy, commands: ThreadPoolExecutor
) -> None:
    engine = make_engine(copy_out=slow, kv_blocks=POOL_BLOCKS, debug_checks=True)
    reader = submit(engine, PARKED_PROMPT, 40)
    parking = start_park(engine, reader, commands)

    cancelling = commands.submit(engine.cancel, reader.request_id, "test")
    wait_until(slow.transfer.waiting.is_set, WAIT_SECONDS, "the engine waiting for the copy")
    # The engine thread waits for the copy: its block tables hold still to be read here.
    assert engine.kv.num_blocks_of(reader.request_id) == 3
    assert engine.kv.num_free_blocks == POOL_BLOCKS - 3
    assert not parking.done() and not cancelling.done()

    slow.gate.set()
    parked, cancelled = parking.result(WAIT_SECONDS), cancelling.result(WAIT_SECONDS)
    assert (parked.status, parked.freed_blocks) == ("parked", 3)
    assert (cancelled.status, cancelled.freed_blocks) == ("cancelled", 0)
    assert reader.cancelled.is_set()
    reader.read_all()
    assert_all_free(engine)
