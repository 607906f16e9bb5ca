"""Coalesced egress: a streaming response's body messages gathered into fewer, larger writes.

Written one token at a time (a write of about 200 bytes), a stream hides a reader that stopped
from the server's kernel: the client's kernel grows its receive buffer to take many small
writes instead of closing its window, so the server's socket looks healthy long after its
reader went away. Writes of about a kilobyte make the window shrink as the reader falls behind
(bench/bench_visibility.py).

The rule, which the reference engine's SSE writer and the ASGI middleware share: the stream's
first token never waits; after it, body messages gather until they hold `coalesce_bytes` (at
least the reader's window unit: `Coalescing.for_connection`), or until `coalesce_ms` have
passed since the first of them, whichever comes first; the response's last message goes at
once, with whatever gathered before it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvwatch.errors import ConfigError

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_COALESCE_BYTES = 1024
# Measured (docs/collector.md, "What the server sees of a reader that stops"): with 100 ms,
# a stream of ~35 tokens/s writes ~850-byte chunks, which a client whose window scale is 10
# (1 KB units) still does not see; 250 ms lets them reach a kilobyte at 20 tokens/s and up,
# but a busy engine's streams (~19 tokens/s behind haproxy on 2 cores) wrote ~850 bytes
# again and a reader that stopped stayed hidden for 30 s; 500 ms reaches a kilobyte down to
# ~10 tokens/s.
DEFAULT_COALESCE_MS = 500
BODY = "http.response.body"
# struct tcp_info: the byte after state, ca_state, retransmits, probes, backoff and options
# holds tcpi_snd_wscale (low four bits: the scale of the window the peer advertises).
_TCP_INFO_WSCALE_BYTE = 6


def window_unit(sock: socket.socket | None) -> int:
    """The unit of the window the connection's reader advertises: 1 << its window scale,
    which Linux rounds the window it offers to (0: unknown, not a TCP socket)."""
    if sock is None or sock.type != socket.SOCK_STREAM:
        return 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_WSCALE_BYTE + 1)
    except OSError:
        return 0
    return 1 << (info[_TCP_INFO_WSCALE_BYTE] & 0x0F)


@dataclass(frozen=True)
class Coalescing:
    """How a stream's writes are gathered: up to `coalesce_bytes` or `coalesce_ms` after the
    first unwritten byte; either 0 turns coalescing off (a write per message)."""

    coalesce_bytes: int = DEFAULT_COALESCE_BYTES
    coalesce_ms: int = DEFAULT_COALESCE_MS

    def __post_init__(self) -> None:
        for name in ("coalesce_bytes", "coalesce_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}", "0 is off")

    @property
    def enabled(self) -> bool:
        return self.coalesce_bytes > 0 and self.coalesce_ms > 0

    def for_connection(self, sock: socket.socket | None) -> Coalescing:
        """These settings for one connection: chunks of at least its reader's window unit
        (`window_unit`), since a write smaller than the unit leaves the window the reader
        offers where it was (a reader whose window scale is 11 needs 2 KB chunks)."""
        unit = window_unit(sock)
        if not self.enabled or unit <= self.coalesce_bytes:
            return self
        return dataclasses.replace(self, coalesce_bytes=unit)


class CoalescedSend:
    """An ASGI `send` for one response that coalesces its body messages after a given one.

    Owned by the server's event loop. Messages pass straight through until the one named by
    `coalesce_after` has been sent (the stream's first token: it never waits), and always when
    coalescing is off. Then a body message that is not the response's last is added to what
    is pending and the call returns at once, unless what is pending reaches `coalesce_bytes`:
    that call waits for its write, as the send it stands in for would. A timer writes what is
    pending `coalesce_ms` after the first of it came, in the background, so a writer feeding
    this send keeps taking output while it gathers.

    Invariants: bytes leave in the order they came, one write at a time (each write waits
    for the one before); what is pending stays below `coalesce_bytes` plus one message; a
    failed write (the client is gone) is raised by the next call; after `discard` nothing
    more is written.
    """

    def __init__(self, send: Send, coalescing: Coalescing) -> None:
        self._send = send
        self._coalescing = coalescing
        self._after: Message | None = None
        self._armed = False
        self._pending = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Future[None] | None = None
        self._failed: BaseException | None = None

    def coalesce_after(self, message: Message) -> None:
        """Coalesces the messages that come after `message` (sent through this send)."""
        self._after = message

    async def __call__(self, message: Message) -> None:
        self._raise_if_failed()
        if not self._armed or message.get("type") != BODY:
            await self.flush()
            await self._send(message)
            if message is self._after:
                self._armed = self._coalescing.enabled
            return
        more_body = bool(message.get("more_body", False))
        self._add(bytes(message.get("body", b"")))
        if not more_body or len(self._pending) >= self._coalescing.coalesce_bytes:
            await asyncio.wait([self._chain(more_body)])
            self._raise_if_failed()

    async def flush(self) -> None:
        """Writes what is pending now and waits until every write is done."""
        if self._pending:
            self._chain(more_body=True)
        if self._writing is not None:
            await asyncio.wait([self._writing])
        self._raise_if_failed()

    def discard(self) -> None:
        """Drops what is pending and stops writing (the response is over, or cut)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            self._writing.cancel()
        self._pending.clear()
        self._failed = self._failed or ConnectionAbortedError("the response was discarded")

    def _add(self, body: bytes) -> None:
        if not self._pending and self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._coalescing.coalesce_ms / 1000, self._on_timer)
        self._pending += body

    def _on_timer(self) -> None:
        self._timer = None
        self._chain(more_body=True)

    def _chain(self, more_body: bool) -> asyncio.Future[None]:
        """Starts a write of what will be pending once the write before it is done. Awaited
        with `asyncio.wait`: its outcome is in `_failed`, and a caller that gives up waiting
        leaves it to finish."""
        self._writing = asyncio.ensure_future(self._write_after(self._writing, more_body))
        return self._writing

    async def _write_after(self, before: asyncio.Future[None] | None, more_body: bool) -> None:
        if before is not None:
            await asyncio.wait([before])
        if self._failed is not None or (more_body and not self._pending):
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        body, self._pending = bytes(self._pending), bytearray()
        try:
            await self._send({"type": BODY, "body": body, "more_body": more_body})
        except asyncio.CancelledError:  # a write cut short: nothing after it may go out
            self._failed = ConnectionAbortedError("a write of the response was cancelled")
            raise
        except Exception as exc:  # the server's send failed: the client is gone
            self._failed = exc

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise OSError(f"the client connection is gone: {self._failed}")
