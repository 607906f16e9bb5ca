"""The egress path of one request: a bounded queue from the engine thread to one reader.

The reader is the HTTP writer (on the event loop, `next_batch`) or a caller waiting on a thread
(`wait_batch`, `collect`). In coupled mode the queue holds a few tokens and the scheduler stops
advancing a request whose queue is full; in decoupled mode it holds the whole generation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.lab.engine.kv_cache import KvCacheInvariantError

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

    Invariants: it holds at most `capacity` tokens; the finish record is set once, nothing is
    put after it, and a reader sees it only together with or after the last tokens; the
    token counts count every token put and taken.
    Ownership: only the engine thread calls `put` and `finish`; only one reader reads.
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
        self._tokens_put = 0
        self._tokens_taken = 0

    def has_room(self) -> bool:
        return len(self._token_ids) < self.capacity

    def token_counts(self) -> tuple[int, int]:
        """Tokens put in all (the request's generated tokens) and taken by the reader."""
        with self._lock:
            return self._tokens_put, self._tokens_taken

    def put(self, token_id: int, text: str) -> None:
        with self._lock:
            if self._finish is not None or len(self._token_ids) >= self.capacity:
                raise KvCacheInvariantError(
                    "token put into a full or finished output queue",
                    "this is a bug in the reference engine's scheduler",
                )
            self._token_ids.append(token_id)
            self._text.append(text)
            self._tokens_put += 1
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
        self._tokens_taken += len(batch.token_ids)
        return batch

    async def next_batch(self) -> Batch:
        """Waits on the event loop until tokens or the finish record are there."""
        while True:
            with self._lock:
                batch = self._take()
                if batch is None:
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
            self._ready.wait_for(
                lambda: bool(self._token_ids) or self._finish is not None, timeout_seconds
            )
            batch = self._take()
        if batch is not None:
            self._on_read()
        return batch
