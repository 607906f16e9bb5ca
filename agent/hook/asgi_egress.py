"""Decoupled egress: the app's `send` returns at once; a task drains to the socket.

A slow client then holds only host memory, not the app's generator (and with it the KV, or
llama-cpp-python's one generation lock) — up to a cap per stream and a cap over all streams,
past which `send` waits again (the coupled behaviour) and the stream is reported full. A
response is decoupled from its start (the middleware's always-decoupled mode) or from the
moment the agent detaches it; a detached one is coupled again at its cap (`retire`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
BUDGET_POLL_SECONDS = 0.05


class EgressBudget:
    """Bytes buffered over all streams of one middleware, against `total_cap_bytes`.

    Owned by the server's event loop (no lock). `peak_bytes` is the most ever buffered at once.
    Invariant: `buffered_bytes` stays within `total_cap_bytes`, unless a single message is
    larger than the cap (it is taken alone, into an empty budget).
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

    def fits(self, count: int) -> bool:
        """Whether `count` more bytes stay within the total cap (an empty budget takes any)."""
        return not self.buffered_bytes or self.buffered_bytes + count <= self.total_cap_bytes


@dataclass(frozen=True)
class EgressLimits:
    """One middleware's egress settings: every streaming response buffered up to
    `decoupled_bytes` from its start (0: none is), a stream the agent detaches buffered up to
    `detach_bytes` (0: none can be), all of them together within `budget`."""

    budget: EgressBudget
    decoupled_bytes: int
    detach_bytes: int


@dataclass(frozen=True)
class _Queued:
    message: Message
    size: int
    sending: asyncio.Future[None] | None  # the server's send of it, when already under way


class EgressBuffer:
    """One response's messages between the app and the server's `send`.

    Invariants: messages leave in the order the app sent them (a send already under way when
    the buffer was made, `adopt`ed, first); a message is admitted only if it fits both this
    buffer's `cap_bytes` of body and the budget (an empty buffer takes any one message), so
    neither is ever over its cap but by a single message larger than it; `full` is True
    exactly while `put` waits for room, or `retire` for the buffer to empty. After the
    server's `send` fails, the drain is cancelled (with whoever waited for it), or `close` is
    called, `put` raises OSError (the client is gone) and the buffer gives its bytes back to
    the budget.
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
        self._messages: deque[_Queued] = deque()
        self._bytes = 0
        self._queued = asyncio.Event()
        self._room = asyncio.Event()
        self._failed: BaseException | None = None
        self._finished = False
        self._input_ended = False
        self.full = False
        self._drainer = asyncio.get_running_loop().create_task(self._drain())

    @property
    def buffered_bytes(self) -> int:
        return self._bytes

    def fits(self, message: Message) -> bool:
        """Whether `message` may be queued now, within this buffer's cap and the budget."""
        size = body_size(message)
        mine = not self._bytes or self._bytes + size <= self._cap_bytes
        return mine and self._budget.fits(size)

    def adopt(self, message: Message, sending: asyncio.Future[None]) -> bool:
        """Queues a message whose server send is already under way (the app's send in flight
        when its stream was detached); False, nothing queued, if it does not fit."""
        if not self.fits(message):
            return False
        self._queue(_Queued(message, body_size(message), sending))
        return True

    async def put(self, message: Message) -> None:
        """Queues `message`; waits only while it does not fit this stream's or the budget's
        cap."""
        while self._failed is None and not self.fits(message):
            self._set_full(True)
            self._room.clear()
            # Other streams' drains free the budget without waking this one: poll it too.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room.wait(), BUDGET_POLL_SECONDS)
        self._set_full(False)
        self._raise_if_failed()
        self._queue(_Queued(message, body_size(message), None))

    async def retire(self) -> None:
        """Ends a detached stream's buffering at its cap: reported full, waits until all it
        holds is sent (the app waits for its client again), then takes nothing more; OSError
        if the client is gone."""
        self._set_full(True)
        await self.finish()
        self._raise_if_failed()

    async def finish(self) -> None:
        """No more messages will come (the app returned): waits until everything queued has
        been sent, or the send failed."""
        self._input_ended = True
        self._queued.set()
        await asyncio.wait([self._drainer])  # a waiter that goes away leaves the drain going

    def close(self, reason: str) -> None:
        """Drops what is queued and stops draining (the connection is being reset)."""
        if self._failed is None:
            self._failed = ConnectionAbortedError(reason)
        self._drainer.cancel()
        self._release()

    def _queue(self, queued: _Queued) -> None:
        self._messages.append(queued)
        self._bytes += queued.size
        self._budget.take(queued.size)
        self._queued.set()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise OSError(f"the client connection is gone: {self._failed}")

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
                queued = self._messages[0]
                message = queued.message
                await (queued.sending if queued.sending is not None else self._send(message))
                self._messages.popleft()
                self._bytes -= queued.size
                self._budget.give_back(queued.size)
                self._finished = message.get("type") == "http.response.body" and not message.get(
                    "more_body", False
                )
                self._room.set()
        except asyncio.CancelledError:  # its waiter went away (the app was cancelled)
            self._failed = self._failed or ConnectionAbortedError("the drain was cancelled")
            self._release()
            raise
        except Exception as exc:  # the server's send failed: the client is gone
            self._failed = exc
            self._release()

    def _release(self) -> None:
        for queued in self._messages:  # adopted sends still waiting for the server
            if queued.sending is not None:
                queued.sending.cancel()
        self._budget.give_back(self._bytes)
        self._bytes = 0
        self._messages.clear()
        self._room.set()


def body_size(message: Message) -> int:
    """The bytes of body a message carries (what the buffers count)."""
    return len(message.get("body", b""))
