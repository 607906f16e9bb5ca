"""One HTTP request seen by the kvwatch ASGI middleware: announce, count, coalesce, cancel,
detach, pause, close."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvwatch.hook.asgi_coalesce import CoalescedSend, Coalescing
from kvwatch.hook.asgi_conn import Connection
from kvwatch.hook.asgi_egress import EgressBuffer, EgressLimits
from kvwatch.hook.asgi_kv import KvGeometry, prompt_tokens
from kvwatch.hook.asgi_pause import PauseGate
from kvwatch.hook.asgi_sse import DataEvent, EventReader
from kvwatch.hook.engine_hook import EngineHook
from kvwatch.hookwire.types import CommandOutcome

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DISCONNECT: Message = {"type": "http.disconnect"}
DISCONNECT_GRACE_SECONDS = 0.5


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def estimated_blocks(geometry: KvGeometry, body_bytes: int, tokens_out: int) -> int:
    """The KV blocks a request is estimated to hold: none before its first token (it may be
    queued, e.g. waiting for llama-cpp-python's one generation lock, and the middleware cannot
    tell), else those of its prompt (from the request body) and of the tokens it streamed."""
    if tokens_out == 0:
        return 0
    return geometry.blocks_for(prompt_tokens(body_bytes) + tokens_out)


@dataclass(frozen=True)
class _InFlight:
    """A send of an announced stream on its way to the server (the app waits for it):
    `handed_over` is resolved when a detach hands it to the stream's new buffer."""

    message: Message
    sending: asyncio.Future[None]
    handed_over: asyncio.Future[None]


class RequestStream:
    """The middleware's view of one request; owned by the server's event loop, except
    `cancel_from_thread` and `command_from_thread`, which the hook's command workers call.

    Invariants: the stream is announced (`open`) at most once, at its first token — the
    first SSE event with data, which carries the engine's request id (comments such as
    sse-starlette's `: ping`, blank keep-alives and events without data are not tokens) — and
    closed exactly once after that; once cancelled, `receive` returns `http.disconnect`
    and `send` raises OSError after a short grace, so the app unwinds through its own
    disconnect path (vLLM's generator cancellation aborts the engine request;
    llama-cpp-python releases its lock). Egress is coupled (`buffer` None), decoupled from
    the response's start (`buffer`, not `detached`), or `detached` by the agent: then the
    sends in flight were handed to `buffer` and the app's sends return at once, until the
    next one would not fit and the stream is coupled again (`buffer` None). Whatever goes to
    the server goes through one `CoalescedSend`, which gathers the body after the first token
    (kvwatch.hook.asgi_coalesce). While `paused`, the app's next body send is held before any
    of that (kvwatch.hook.asgi_pause); a detach unpauses the stream, and a detached stream is
    not paused.
    """

    def __init__(
        self,
        hook: EngineHook,
        geometry: KvGeometry,
        connection: Connection | None,
        fallback_id: str,
        header_id: str | None,
        on_open: Callable[[RequestStream], None],
        send: Send,
        egress: EgressLimits,
        coalescing: Coalescing,
    ) -> None:
        self._hook = hook
        self._on_open = on_open
        self._geometry = geometry
        transport = connection.transport if connection is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        self._send = CoalescedSend(send, coalescing.for_connection(sock))
        self._egress = egress
        self.connection = connection
        self._fallback_id = fallback_id
        self._header_id = header_id
        self._loop = asyncio.get_running_loop()
        self.request_id: str | None = None
        self.opened = False
        self._streaming = False
        self._events = EventReader()
        self._kept: Message | None = None
        self._body_bytes = 0
        self.tokens_out = 0
        self.finished = False
        self.cancelled = asyncio.Event()
        self.app_done = threading.Event()
        self.buffer: EgressBuffer | None = None
        self.detached = False
        self._in_flight: list[_InFlight] = []
        self._gate = PauseGate(self.cancelled, connection)

    def kv_blocks(self) -> int:
        if self.app_done.is_set():
            return 0  # the app returned: the engine has let the request go
        return estimated_blocks(self._geometry, self._body_bytes, self.tokens_out)

    async def receive(self, receive: Receive) -> Message:
        """The server's next message, or `http.disconnect` once cancelled. A caller that gives
        up waiting (Starlette's `is_disconnected` polls with a cancelled scope) loses nothing:
        the server's receive is cancelled with it, or its message is kept for the next call."""
        if self._kept is not None:
            message, self._kept = self._kept, None
            return self._counted(message)
        if self.cancelled.is_set():
            return DISCONNECT
        inner = asyncio.ensure_future(receive())
        cancel = asyncio.ensure_future(self.cancelled.wait())
        try:
            await asyncio.wait((inner, cancel), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if inner.done() and not inner.cancelled() and inner.exception() is None:
                self._kept = inner.result()
            raise
        finally:
            cancel.cancel()
            if not inner.done():
                inner.cancel()
        if inner.cancelled() or not inner.done():
            return DISCONNECT
        return self._counted(inner.result())

    def _counted(self, message: Message) -> Message:
        if message.get("type") == "http.request":
            self._body_bytes += len(message.get("body", b""))
        return message

    async def send(self, message: Message) -> None:
        """The app's send: to the server (coupled) or to the stream's buffer."""
        kind = message.get("type")
        if kind == "http.response.body":
            await self._gate.hold()
        if self.cancelled.is_set():
            await _refuse_after_grace()
        if kind == "http.response.start":
            self._streaming = _is_event_stream(message)
            if self._streaming and self._egress.decoupled_bytes:
                self.buffer = self._new_buffer(self._egress.decoupled_bytes)
        elif kind == "http.response.body" and self._streaming:
            first_token = self.tokens_out == 0
            self._read_body(bytes(message.get("body", b"")), bool(message.get("more_body", False)))
            if first_token and self.tokens_out:
                self._send.coalesce_after(message)  # the first token never waits
        if self.buffer is not None and self.detached and not self.buffer.fits(message):
            await self._guarded(self._couple_again())
        if self.buffer is not None:
            await self._guarded(self.buffer.put(message))
        elif self.opened:
            await self._send_detachable(message)
        else:  # the agent cannot cancel or detach what it never heard of: no race needed
            await self._send(message)

    async def _guarded(self, put: Awaitable[None]) -> None:
        """Awaits `put`; once the agent knows the stream, a cancel ends the wait (and the
        app's send, after a grace)."""
        if not self.opened:
            await put
        elif not await self._until_cancelled(put):
            await _refuse_after_grace()

    async def _send_detachable(self, message: Message) -> None:
        """A coupled send the agent may cancel, or detach: a detach hands it, still under way,
        to the new buffer and returns to the app at once."""
        sending = asyncio.ensure_future(self._send(message))
        in_flight = _InFlight(message, sending, self._loop.create_future())
        self._in_flight.append(in_flight)
        try:
            if not await self._until_cancelled(sending, in_flight.handed_over):
                await _refuse_after_grace()
        finally:
            self._in_flight.remove(in_flight)

    async def _couple_again(self) -> None:
        """A detached stream's next message does not fit its buffer: reported full, the app
        waits until the buffer has drained, then sends straight to the server again."""
        assert self.buffer is not None, "only a detached stream is coupled again"
        await self.buffer.retire()
        self.buffer, self.detached = None, False
        self.report()

    async def end_egress(self, *, returned: bool) -> None:
        """After the app ended: once it `returned` normally, waits until what the buffer holds
        and what the coalescer gathered are sent (a cancel meanwhile drops them and resets);
        otherwise drops them."""
        if returned and not self.cancelled.is_set():
            if self.buffer is not None:
                self.report()  # kv_blocks is 0 now: the app let the request go
            if not await self._until_cancelled(self._flush()):
                self.drop("cancelled by kvwatch")
        elif not returned and self.buffer is not None:
            self.buffer.close("the app failed")
        self._send.discard()

    async def _flush(self) -> None:
        if self.buffer is not None:
            await self.buffer.finish()
        with contextlib.suppress(OSError):  # the client is gone: nothing left to send to
            await self._send.flush()

    def drop(self, reason: str) -> None:
        """Ends a cancelled stream's connection: its buffered output dropped, then a reset."""
        if self.buffer is not None:
            self.buffer.close(reason)
        self._send.discard()
        if self.connection is not None:
            self.connection.reset()

    def cancel_from_thread(self, reason: str, timeout_seconds: float) -> CommandOutcome:
        """Delivers http.disconnect on the loop and waits for the app to return."""
        request_id = self.request_id or self._fallback_id
        if self.app_done.is_set():  # decoupled egress: generation ended, only bytes remain
            self._loop.call_soon_threadsafe(self.cancelled.set)
            detail = "the engine had finished generating; only buffered output was dropped"
            return CommandOutcome(request_id, "already_finished", 0, 0, detail)
        blocks = self.kv_blocks()
        self._loop.call_soon_threadsafe(self.cancelled.set)
        if not self.app_done.wait(timeout_seconds):
            detail = f"the app did not return within {timeout_seconds:g} s of http.disconnect"
            return CommandOutcome(request_id, "failed", 0, 0, detail)
        freed = blocks * self._geometry.bytes_per_block
        return CommandOutcome(request_id, "cancelled", blocks, freed, f"{reason}; KV estimated")

    def command_from_thread(
        self, command: Coroutine[Any, Any, CommandOutcome], timeout_seconds: float
    ) -> CommandOutcome:
        """Runs `command` (`detach()`, `pause()`, `release()`) on the loop and returns its
        outcome (`failed` if the loop did not get to it in time)."""
        future = asyncio.run_coroutine_threadsafe(command, self._loop)
        try:
            return future.result(timeout_seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()
            detail = f"the server's event loop did not run it within {timeout_seconds:g} s"
            return CommandOutcome(self.request_id or self._fallback_id, "failed", 0, 0, detail)

    async def pause(self) -> CommandOutcome:
        """Holds the app's next body send until `release` (kvwatch.hook.asgi_pause); a
        paused stream is paused again (the hook renews its lease). Declined for a stream
        being cancelled or detached (its generation is meant to run to its end)."""
        request_id = self.request_id or self._fallback_id
        if self.app_done.is_set():
            return CommandOutcome(request_id, "already_finished", 0, 0, "the app has returned")
        if self.cancelled.is_set():
            return CommandOutcome(request_id, "declined", 0, 0, "it is being cancelled")
        if self.detached:
            why = "it is detached: its generation runs to its end"
            return CommandOutcome(request_id, "declined", 0, 0, why)
        self._gate.pause()
        return CommandOutcome(request_id, "paused")

    async def release(self) -> CommandOutcome:
        """Lets the held send go on; "not_held" when the stream is not paused."""
        request_id = self.request_id or self._fallback_id
        if self.app_done.is_set():
            return CommandOutcome(request_id, "already_finished", 0, 0, "the app has returned")
        if not self._gate.paused:
            return CommandOutcome(request_id, "not_held", 0, 0, "it is not paused")
        self._gate.release()
        return CommandOutcome(request_id, "released")

    async def detach(self) -> CommandOutcome:
        """From now on the app's sends go to a buffer of up to `detach_bytes`, the send in
        flight (if any) first; declined if the stream is buffered already or the buffers
        have no room for that send. A paused stream is unpaused. Runs on the loop without
        yielding to it."""
        request_id = self.request_id or self._fallback_id
        if self.buffer is not None:
            why = "it is detached already"
            if not self.detached:
                why = "every response is buffered here already (KVWATCH_EGRESS_BUFFER_BYTES)"
            return CommandOutcome(request_id, "declined", 0, 0, why)
        if self.app_done.is_set():
            return CommandOutcome(request_id, "already_finished", 0, 0, "the app has returned")
        if self.cancelled.is_set():
            return CommandOutcome(request_id, "declined", 0, 0, "it is being cancelled")
        buffer = self._new_buffer(self._egress.detach_bytes)
        if not all(buffer.adopt(f.message, f.sending) for f in self._in_flight):
            buffer.close("the detach was declined")
            budget = self._egress.budget
            detail = (
                f"no room for the output in flight: {budget.buffered_bytes} of "
                f"{budget.total_cap_bytes} bytes buffered, {self._egress.detach_bytes} per stream"
            )
            return CommandOutcome(request_id, "declined", 0, 0, detail)
        for in_flight in self._in_flight:
            in_flight.handed_over.set_result(None)
        self.buffer, self.detached = buffer, True
        self._gate.release()  # a held send goes on, into the buffer
        return CommandOutcome(request_id, "detached", 0, 0, buffered_bytes=buffer.buffered_bytes)

    def _new_buffer(self, cap_bytes: int) -> EgressBuffer:
        return EgressBuffer(self._send, cap_bytes, self._egress.budget, self._report_full)

    async def _until_cancelled(
        self, awaitable: Awaitable[None], handed_over: asyncio.Future[None] | None = None
    ) -> bool:
        """Awaits `awaitable`; False (and `awaitable` cancelled) if the request is cancelled
        first; True at once, `awaitable` left running, if it is `handed_over` first."""
        inner = asyncio.ensure_future(awaitable)
        cancel = asyncio.ensure_future(self.cancelled.wait())
        waits = (inner, cancel) if handed_over is None else (inner, cancel, handed_over)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancel.cancel()
            if not inner.done() and not (handed_over is not None and handed_over.done()):
                inner.cancel()
        if inner.done() and not inner.cancelled():
            inner.result()
            return True
        return handed_over is not None and handed_over.done()

    def _read_body(self, body: bytes, more_body: bool) -> None:
        """Counts the tokens (data events but `[DONE]`) in `body`; announces at the first."""
        self.finished = not more_body
        tokens = [event for event in self._events.feed(body) if not event.is_done]
        if not tokens:
            return
        self.tokens_out += len(tokens)
        if self.request_id is None:
            self._announce(tokens[0])
        self.report()

    def _announce(self, first: DataEvent) -> None:
        """Names the request (X-Request-Id, else the first token's id, else the fallback) and
        opens it with the agent, if its connection is known."""
        self.request_id = self._header_id or first.request_id() or self._fallback_id
        connection = self.connection
        if connection is None:
            return
        self._on_open(self)  # before the agent can hear of it: a cancel may follow at once
        self._hook.stream_opened(
            self.request_id,
            connection.local,
            connection.remote,
            self.kv_blocks(),
            kv_estimated=True,
        )
        self.opened = True

    def report(self) -> None:
        """Sends the stream's current numbers to the agent (coalesced by the hook)."""
        if self.opened and self.request_id is not None:
            full = self.buffer is not None and self.buffer.full
            self._hook.stream_updated(
                self.request_id, self.kv_blocks(), self.tokens_out, egress_buffer_full=full
            )

    def _report_full(self, full: bool) -> None:
        """The egress buffer's callback when it fills or frees up (`report` reads `full`)."""
        self.report()


async def _refuse_after_grace() -> None:
    """How a cancelled request's `send` ends: first a grace period in which an app that
    listens for `http.disconnect` (Starlette under ASGI < 2.4, sse-starlette, vLLM, SGLang)
    cancels its own send and runs its disconnect path, then OSError (ASGI 2.4's signal that
    the client is gone) for apps that do not listen."""
    await asyncio.sleep(DISCONNECT_GRACE_SECONDS)
    raise OSError("the request was cancelled by kvwatch")


def _is_event_stream(message: Message) -> bool:
    for key, value in message.get("headers", ()):
        if bytes(key).lower() == b"content-type":
            return bytes(value).lower().startswith(b"text/event-stream")
    return False
