"""Decoupled egress: the app's `send` returns at once; a task drains to the socket.

A slow client then holds only host memory, not the app's generator (and with it the KV, or
llama-cpp-python's one generation lock) — up to a cap per stream and a cap over all streams,
past which `send` waits again (the coupled behaviour) and the stream is reported full.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
BUDGET_POLL_SECONDS = 0.05


class EgressBudget:
    """Bytes buffered over all streams of one middleware, against `total_cap_bytes`.

    Owned by the server's event loop (no lock). `peak_bytes` is the most ever buffered at once.
    """

    def __init__(self, total_cap_bytes: int) -> None:
        self.total_cap_bytes = total_cap_bytes
        self.buffered_bytes = 0
        self.peak_bytes = 0

    def take(self, count: int) -> None:
        self.buffered_bytes += count
        self.peak_bytes = max(self.peak_bytes, self.buffered_bytes)

    def give_back(self, count: int) -> None:
        self.buffered_bytes -= count


class EgressBuffer:
    """One response's messages between the app and the server's `send`.

    Invariants: messages leave in the order the app sent them; the buffer holds at most
    `cap_bytes` of body (a message is admitted while the stream is under its cap and the budget
    under its total, so each may overshoot by one message); `full` is True exactly while `put`
    waits for room. After the server's `send` fails, or `close` is called, `put` raises
    OSError (the client is gone) and the buffer gives its bytes back to the budget.
    """

    def __init__(
        self,
        send: Send,
        cap_bytes: int,
        budget: EgressBudget,
        on_full: Callable[[bool], None],
    ) -> None:
        self._send = send
        self._cap_bytes = cap_bytes
        self._budget = budget
        self._on_full = on_full
        self._messages: deque[tuple[Message, int]] = deque()
        self._bytes = 0
        self._queued = asyncio.Event()
        self._room = asyncio.Event()
        self._failed: BaseException | None = None
        self._finished = False
        self._input_ended = False
        self.full = False
        self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def put(self, message: Message) -> None:
        """Queues `message`; waits only while this stream or the budget is over its cap."""
        while self._failed is None and self._over_cap():
            self._set_full(True)
            self._room.clear()
            # Other streams' drains free the budget without waking this one: poll it too.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room.wait(), BUDGET_POLL_SECONDS)
        self._set_full(False)
        if self._failed is not None:
            raise OSError(f"the client connection is gone: {self._failed}")
        size = len(message.get("body", b""))
        self._messages.append((message, size))
        self._bytes += size
        self._budget.take(size)
        self._queued.set()

    async def finish(self) -> None:
        """No more messages will come (the app returned): waits until everything queued has
        been sent, or the send failed."""
        self._input_ended = True
        self._queued.set()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await self._drainer

    def close(self, reason: str) -> None:
        """Drops what is queued and stops draining (the connection is being reset)."""
        if self._failed is None:
            self._failed = ConnectionAbortedError(reason)
        self._drainer.cancel()
        self._release()

    def _over_cap(self) -> bool:
        budget = self._budget
        return self._bytes >= self._cap_bytes or budget.buffered_bytes >= budget.total_cap_bytes

    def _set_full(self, full: bool) -> None:
        if full != self.full:
            self.full = full
            self._on_full(full)

    async def _drain(self) -> None:
        try:
            while not self._finished:
                while not self._messages:
                    if self._input_ended:
                        return  # the app returned without ending its response: nothing left
                    self._queued.clear()
                    await self._queued.wait()
                message, size = self._messages[0]
                await self._send(message)
                self._messages.popleft()
                self._bytes -= size
                self._budget.give_back(size)
                self._finished = message.get("type") == "http.response.body" and not message.get(
                    "more_body", False
                )
                self._room.set()
        except Exception as exc:  # the server's send failed: the client is gone
            self._failed = exc
            self._release()
            raise OSError(f"sending the buffered response failed: {exc}") from exc

    def _release(self) -> None:
        self._budget.give_back(self._bytes)
        self._bytes = 0
        self._messages.clear()
        self._room.set()
