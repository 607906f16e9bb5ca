"""The egress path of one request: a bounded queue from the engine thread to one reader.

The reader is the HTTP writer (on the event loop, `next_batch`) or a caller waiting on a thread
(`wait_batch`, `collect`). In coupled mode the queue holds a few tokens and the scheduler stops
advancing a request whose queue is full; in decoupled mode it holds the whole generation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.engine.kv_cache import KvCacheInvariantError

FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass(frozen=True)
class Finish:
    """How a request ended. `cancelled` is True when `Engine.cancel` ended it (the connection is
    then reset rather than closed)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cancelled: bool = False
    detail: str = ""


@dataclass(frozen=True)
class Batch:
    """What a reader got: the tokens produced since its last read (ids and the text of each),
    and the finish record once every token before it has been read."""

    token_ids: list[int]
    texts: list[str]
    finish: Finish | None


class OutputChannel:
    """Bounded token queue, engine thread -> one reader.

    Invariants: it holds at most `capacity` tokens; the capacity only grows; the finish record
    is set once, nothing is put after it, and a reader sees it only together with or after the
    last tokens.
    Ownership: only the engine thread calls `put`, `finish` and `raise_capacity`; only one
    reader reads.
    """

    def __init__(self, capacity: int, on_read: Callable[[], None]) -> None:
        self.capacity = capacity
        self._on_read = on_read
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._finish: Finish | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        # The reader's comings and goings: batches it took, when it last took one (or the
        # queue was made), and whether it is waiting for output now (kvwatch.engine.parking).
        self.batches_taken = 0
        self._left_ns = time.monotonic_ns()
        self._reader_waiting = False

    def has_room(self) -> bool:
        return len(self._token_ids) < self.capacity

    @property
    def unread(self) -> int:
        """Tokens put and not yet taken by the reader."""
        return len(self._token_ids)

    def raise_capacity(self, capacity: int) -> None:
        """Lets the queue hold up to `capacity` tokens from now on (never fewer than now)."""
        self.capacity = max(self.capacity, capacity)

    def held_seconds(self, now_ns: int) -> float:
        """How long the reader has been away with its last batch (its writer held in a
        send, when the client does not read); 0 while it waits for output."""
        with self._lock:
            return 0.0 if self._reader_waiting else max(0, now_ns - self._left_ns) / 1e9

    def is_spent(self) -> bool:
        """True once finished and empty: it holds no tokens now and will hold none again."""
        with self._lock:
            return self._finish is not None and not self._token_ids

    def put(self, token_id: int, text: str) -> None:
        with self._lock:
            if self._finish is not None or len(self._token_ids) >= self.capacity:
                raise KvCacheInvariantError(
                    "token put into a full or finished output queue",
                    "this is a bug in the reference engine's scheduler",
                )
            self._token_ids.append(token_id)
            self._text.append(text)
            self._notify()

    def finish(self, finish: Finish) -> None:
        with self._lock:
            if self._finish is None:
                self._finish = finish
                self._notify()

    def _notify(self) -> None:
        self._ready.notify_all()
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)
            self._loop = None

    def _take(self) -> Batch | None:
        if not self._token_ids and self._finish is None:
            return None
        batch = Batch(self._token_ids, self._text, self._finish)
        self._token_ids, self._text = [], []
        self.batches_taken += 1
        self._left_ns = time.monotonic_ns()
        self._reader_waiting = False
        return batch

    async def next_batch(self) -> Batch:
        """Waits on the event loop until tokens or the finish record are there."""
        while True:
            with self._lock:
                batch = self._take()
                if batch is None:
                    self._reader_waiting = True
                    self._loop = asyncio.get_running_loop()
                    self._event = self._event or asyncio.Event()
                    self._event.clear()
            if batch is not None:
                self._on_read()
                return batch
            assert self._event is not None
            await self._event.wait()

    def wait_batch(self, timeout_seconds: float | None = None) -> Batch | None:
        """Waits on this thread; None when the timeout passed with nothing to read."""
        with self._lock:
            self._reader_waiting = True
            self._ready.wait_for(
                lambda: bool(self._token_ids) or self._finish is not None, timeout_seconds
            )
            self._reader_waiting = False
            batch = self._take()
        if batch is not None:
            self._on_read()
        return batch
