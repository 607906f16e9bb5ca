"""A real agent side for tests whose engine runs in this process: kvwatch's own `HookServer`
on an event loop in a thread of its own, driven from the test's thread."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import ChangeCallback, EngineStream
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.waiting import wait_for

CALL_SECONDS = 30.0
BACKED_UP_SECONDS = 0.5  # no new token for this long: a generation waits for its client
# Every stream fills its client's and its server's buffers before it waits: the bound grows
# with the streams (200 of them, 4 KiB events, took over 30 s in CI's parallel suite).
BACKED_UP_SECONDS_PER_STREAM = 0.5
_T = TypeVar("_T")


class HookServerThread:
    """Owns a thread running an event loop with a started HookServer on `path` (allowing
    this process's uid; `on_change` runs on that loop); `close` stops both."""

    def __init__(self, path: str, on_change: ChangeCallback | None = None) -> None:
        self.path = path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        # Per request: when an update last said its KV went from held to none (monotonic s),
        # kept after the stream closes, so a test cannot miss a generation's end between polls.
        self.kv_freed_at: dict[str, float] = {}
        self._held_kv: set[str] = set()

        def changed(request_id: str, stream: EngineStream | None) -> None:
            if stream is not None and stream.kv_blocks > 0:
                self._held_kv.add(request_id)
            elif stream is not None and request_id in self._held_kv:
                self._held_kv.discard(request_id)
                self.kv_freed_at[request_id] = time.monotonic()
            if on_change is not None:
                on_change(request_id, stream)

        self.server = HookServer(path, allowed_uids=(os.geteuid(),), on_change=changed)
        self.call(self.server.start())

    def call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Runs `coroutine` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CALL_SECONDS)

    def streams(self) -> dict[str, EngineStream]:
        """The live streams by request id."""

        async def read() -> list[EngineStream]:
            return self.server.streams()

        return {stream.request_id: stream for stream in self.call(read())}

    def stream(self, request_id: str | None = None) -> EngineStream | None:
        """The live stream `request_id` (or, without one, the only live stream), else None."""
        streams = self.streams()
        if request_id is None:
            return next(iter(streams.values())) if len(streams) == 1 else None
        return streams.get(request_id)

    def backed_up(self, count: int = 1) -> list[EngineStream]:
        """The `count` live streams, once none had a new token for BACKED_UP_SECONDS: their
        generations wait for their clients (the trigger an agent would see, without one)."""
        seen: dict[str, int] = {}
        since = [time.monotonic()]

        def settled() -> list[EngineStream] | None:
            streams = self.streams()
            tokens = {request_id: stream.tokens_out for request_id, stream in streams.items()}
            if len(streams) != count or tokens != seen:
                seen.clear()
                seen.update(tokens)
                since[0] = time.monotonic()
                return None
            quiet = time.monotonic() - since[0] >= BACKED_UP_SECONDS
            return list(streams.values()) if quiet else None

        bound = CALL_SECONDS + count * BACKED_UP_SECONDS_PER_STREAM
        return wait_for(settled, bound, f"{count} streams whose clients read no more", 0.05)

    def command(self, name: str, request_id: str) -> CommandOutcome:
        """Sends the hook command `name` (cancel, detach ...) as the agent would, and waits."""
        evidence = {"test": "agent/lab/agent_thread.py"}
        return self.call(self.server.command(name, request_id, "test", evidence))

    def close(self) -> None:
        self.call(self.server.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
