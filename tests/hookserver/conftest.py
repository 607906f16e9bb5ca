"""Helpers for the hook server tests: a running HookServer and engines to talk to it.

pytest-asyncio is not used: each test runs its scenario with `run_async` (asyncio.run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from kvwatch.hook import CommandHandler, CommandOutcome, EngineHook, EngineInfo
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookwire.protocol import LineFramer, Message, encode
from kvwatch.lab.waiting import wait_until_async

WAIT_SECONDS = 5.0
BYTES_PER_BLOCK = 16384
ENGINE_INFO = EngineInfo(
    engine="kvwatch-reference",
    model="tiny",
    pid=os.getpid(),  # the hook runs in this process, as it does in an engine
    bytes_per_block=BYTES_PER_BLOCK,
    device="cpu",
    kv_blocks_total=128,
)


def run_async(scenario: Coroutine[Any, Any, None], timeout_seconds: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(scenario, timeout_seconds))


async def wait_until(predicate: Callable[[], bool], timeout_seconds: float = WAIT_SECONDS) -> None:
    """kvwatch.lab.waiting.wait_until_async with these tests' default timeout, looking every
    10 ms."""
    await wait_until_async(predicate, timeout_seconds, poll_seconds=0.01)


class ChangeLog:
    """Records every on_change call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, EngineStream | None]] = []

    def __call__(self, request_id: str, stream: EngineStream | None) -> None:
        self.calls.append((request_id, stream))

    def removed(self) -> list[str]:
        return [request_id for request_id, stream in self.calls if stream is None]


@contextlib.asynccontextmanager
async def running_server(path: str, **options: Any) -> AsyncIterator[tuple[HookServer, ChangeLog]]:
    """A started HookServer that allows this process's uid; closed afterwards."""
    changes = ChangeLog()
    options.setdefault("allowed_uids", (os.geteuid(),))
    server = HookServer(path, on_change=changes, **options)
    await server.start()
    try:
        yield server, changes
    finally:
        await server.close()


def unknown_handler(request_id: str, reason: str) -> CommandOutcome:
    return CommandOutcome(request_id, "unknown_request", 0, 0, detail=f"no request ({reason})")


@contextlib.asynccontextmanager
async def engine_hook(
    path: str,
    handler: CommandHandler = unknown_handler,
    *,
    reconnect_seconds: float = 0.2,
    park_handler: CommandHandler | None = None,
    detach_handler: CommandHandler | None = None,
    pause_handler: CommandHandler | None = None,
    release_handler: CommandHandler | None = None,
) -> AsyncIterator[EngineHook]:
    """A started EngineHook on `path` (fast reconnects unless told), with the command
    handlers given; stopped off the loop."""
    hook = EngineHook(
        ENGINE_INFO,
        handler,
        path,
        reconnect_seconds=reconnect_seconds,
        park_handler=park_handler,
        detach_handler=detach_handler,
        pause_handler=pause_handler,
        release_handler=release_handler,
    )
    hook.start()
    try:
        yield hook
    finally:
        await asyncio.to_thread(hook.stop)


class RawEngine:
    """A hand-driven engine connection: writes any bytes, reads the agent's messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._framer = LineFramer(sender="agent")
        self._received: list[Message] = []

    @classmethod
    async def connect(cls, path: str) -> RawEngine:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer)

    async def send(self, *items: Message | bytes) -> None:
        for item in items:
            self._writer.write(encode(item) if isinstance(item, Message) else item)
        await self._writer.drain()

    async def receive(self, timeout_seconds: float = WAIT_SECONDS) -> Message:
        """The agent's next message; AssertionError on end of stream or timeout."""
        while not self._received:
            data = await asyncio.wait_for(self._reader.read(65536), timeout_seconds)
            if not data:
                raise AssertionError("the agent closed the connection")
            for item in self._framer.feed(data):
                assert isinstance(item, Message), item
                self._received.append(item)
        return self._received.pop(0)

    async def at_eof(self, timeout_seconds: float = WAIT_SECONDS) -> bool:
        """True once the agent has closed the connection (after any messages still unread)."""
        try:
            while await asyncio.wait_for(self._reader.read(65536), timeout_seconds):
                pass
        except ConnectionResetError:
            pass
        return True

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


def exchange_as_uid(path: str, uid: int, payload: bytes) -> bytes:
    """Connects from a forked child running as `uid` (all groups dropped to `uid`), sends
    `payload` and returns what the agent sent back until it closed. Needs root."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # the child: only plain syscalls, then _exit without Python's cleanup
        status = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(WAIT_SECONDS)
                sock.connect(path)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(payload)  # the agent may refuse before it arrives
                with contextlib.suppress(ConnectionResetError):
                    while chunk := sock.recv(65536):
                        os.write(write_fd, chunk)
        except BaseException as exc:
            os.write(write_fd, f"child failed: {exc!r}".encode())
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    received = bytearray()
    with os.fdopen(read_fd, "rb") as pipe:
        received += pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, received.decode(errors="replace")
    return bytes(received)
