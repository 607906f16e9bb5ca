"""Pause in the ASGI middleware: an engine whose step the middleware cannot pause is paused
from its HTTP side, by no longer taking its response.

While a stream is paused, the app's next body `send` is held (not sent, not buffered) until
the agent releases it, or the hook does when the agent's lease runs out or its connection
ends. An engine whose generation is pulled by its response (llama-cpp-python: its publisher
waits for each send) stops generating there; one that generates ahead into a queue of its own
(vLLM, SGLang) keeps it in that queue. Nothing is reordered or lost: the held message is sent
as it was once released. A cancel ends the hold (the app's send is then refused after the
usual grace), and so does the client going away (the send then goes to the server, which
deals with a gone client as it would without kvwatch).
"""

from __future__ import annotations

import asyncio

from kvwatch.hook.asgi_conn import Connection

# How often a held send looks whether its client went away (the server says so only to a
# send or a receive, and the app is in neither).
CLIENT_POLL_SECONDS = 0.1


class PauseGate:
    """Whether one stream's sends may go on; owned by the server's event loop.

    Invariant: `paused` is True from `pause` until `release`; `hold` returns at once while
    not paused, else once released, `cancelled` is set or the client connection closed."""

    def __init__(self, cancelled: asyncio.Event, connection: Connection | None) -> None:
        self._cancelled = cancelled
        self._connection = connection
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def hold(self) -> None:
        """Waits while paused (see the class docstring)."""
        while self.paused and not self._cancelled.is_set():
            if self._connection is not None and self._connection.closed():
                return
            waits = [asyncio.ensure_future(event.wait()) for event in (self._open, self._cancelled)]
            try:
                await asyncio.wait(
                    waits, timeout=CLIENT_POLL_SECONDS, return_when="FIRST_COMPLETED"
                )
            finally:
                for wait in waits:
                    wait.cancel()
