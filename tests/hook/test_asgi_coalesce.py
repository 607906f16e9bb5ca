"""`CoalescedSend` on its own, against a recording ASGI send: what passes through, when it
writes, in what order, how a blocked or failed write shows to the sender. Over real HTTP:
tests/engine/test_coalesce.py (the reference engine) and tests/hook/test_asgi_pause.py (the
middleware)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvwatch.errors import ConfigError
from kvwatch.hook.asgi_coalesce import CoalescedSend, Coalescing, Message
from kvwatch.lab.waiting import wait_until_async

WAIT_SECONDS = 5.0


class Server:
    """A recording `send`; while `open` is clear, writes wait; with `fail`, they raise;
    `calls` counts the writes begun."""

    def __init__(self) -> None:
        self.calls = 0
        self.writes: list[Message] = []
        self.open = asyncio.Event()
        self.open.set()
        self.fail = False

    async def __call__(self, message: Message) -> None:
        self.calls += 1
        await self.open.wait()
        if self.fail:
            raise OSError("the client is gone")
        self.writes.append(message)

    @property
    def bodies(self) -> list[bytes]:
        return [m.get("body", b"") for m in self.writes if m["type"] == "http.response.body"]


def body(data: bytes, more_body: bool = True) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more_body}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), WAIT_SECONDS * 2))


def test_messages_pass_through_until_the_first_token_and_when_coalescing_is_off() -> None:
    async def scenario() -> None:
        for coalescing in Coalescing(coalesce_bytes=0), Coalescing(coalesce_ms=0):
            server = Server()
            send = CoalescedSend(server, coalescing)
            first = body(b"a")
            send.coalesce_after(first)
            for message in (first, body(b"b"), body(b"c", more_body=False)):
                await send(message)
            assert server.bodies == [b"a", b"b", b"c"]
        server = Server()
        send = CoalescedSend(server, Coalescing())
        await send({"type": "http.response.start", "status": 200})
        await send(body(b": ping\n\n"))  # not the first token: it passes
        assert server.bodies == [b": ping\n\n"]

    run(scenario)


def test_after_the_first_token_bodies_gather_up_to_the_size_and_the_last_goes_at_once() -> None:
    async def scenario() -> None:
        server = Server()
        send = CoalescedSend(server, Coalescing(coalesce_bytes=10, coalesce_ms=60_000))
        first = body(b"0")
        send.coalesce_after(first)
        await send(first)
        for data in (b"1234", b"5678", b"9abc", b"de"):
            await send(body(data))
        await send(body(b"!", more_body=False))
        assert server.bodies == [b"0", b"123456789abc", b"de!"]
        assert [m["more_body"] for m in server.writes] == [True, True, False]

    run(scenario)


def test_what_gathered_is_written_coalesce_ms_after_its_first_byte() -> None:
    async def scenario() -> None:
        server = Server()
        send = CoalescedSend(server, Coalescing(coalesce_bytes=1 << 20, coalesce_ms=20))
        first = body(b"0")
        send.coalesce_after(first)
        await send(first)
        await send(body(b"1"))
        await send(body(b"2"))
        assert server.bodies == [b"0"]  # gathered, not written yet
        await wait_until_async(lambda: len(server.bodies) == 2, WAIT_SECONDS, "the timer")
        assert server.bodies == [b"0", b"12"]

    run(scenario)


def test_a_blocked_write_holds_the_sender_only_once_what_gathered_is_full() -> None:
    async def scenario() -> None:
        server = Server()
        send = CoalescedSend(server, Coalescing(coalesce_bytes=4, coalesce_ms=1))
        first = body(b"0")
        send.coalesce_after(first)
        await send(first)
        server.open.clear()  # the client stops reading
        await send(body(b"12"))
        await wait_until_async(lambda: server.calls == 2, WAIT_SECONDS, "the timer's write")
        await send(body(b"3"))  # returns: the write under way has what came before
        blocked = asyncio.ensure_future(send(body(b"4567")))  # full: it must write
        await asyncio.sleep(0.05)  # deliberate: it must go on waiting for the client
        assert not blocked.done()
        server.open.set()
        await blocked
        await send(body(b"", more_body=False))
        assert b"".join(server.bodies) == b"01234567"

    run(scenario)


def test_a_failed_write_is_raised_to_the_sender_and_nothing_follows_it() -> None:
    async def scenario() -> None:
        server = Server()
        send = CoalescedSend(server, Coalescing(coalesce_bytes=1 << 20, coalesce_ms=1))
        first = body(b"0")
        send.coalesce_after(first)
        await send(first)
        server.fail = True
        await send(body(b"1"))
        await wait_until_async(lambda: server.calls == 2, WAIT_SECONDS, "the timer's write")
        server.fail = False
        with pytest.raises(OSError, match="the client is gone"):
            await send(body(b"2"))
        assert server.bodies == [b"0"]

    run(scenario)


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ConfigError, match="coalesce_bytes"):
        Coalescing(coalesce_bytes=-1)
