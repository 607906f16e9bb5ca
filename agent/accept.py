"""`AcceptLoop`: accepts connections on a listening socket without ever spinning or flooding
the log when the process runs out of descriptors.

asyncio's own accept loop reports EMFILE once per pending connection, with a traceback, and
schedules one retry per report: under a connection flood that is a log line per microsecond
and a loop that never rests (issue #13). This loop asks its owner to free a descriptor, then
waits, doubling the pause from BACKOFF_MIN_SECONDS to BACKOFF_MAX_SECONDS, logging once per
exhaustion episode.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

BACKOFF_MIN_SECONDS = 0.01
BACKOFF_MAX_SECONDS = 1.0
# What the kernel answers when a descriptor or the memory for one is missing: transient.
EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The connection died between the kernel queueing it and accept(): nothing to do.
GONE_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})

Handler = Callable[[socket.socket], None]
_log = logging.getLogger("kvwatch.accept")


class AcceptLoop:
    """Accepts on `listener` (already listening, non-blocking) and passes each connection to
    `handle`, which owns it from then on (it must close it, and must not raise: an exception
    closes the connection and is logged). `on_exhausted` is called when accept() fails for
    want of a descriptor and should free one (drop a connection) if it can.

    Owned by one event loop; `run` ends only when cancelled. `exhausted_total` counts accept
    failures for want of resources.
    """

    def __init__(
        self,
        name: str,
        listener: socket.socket,
        handle: Handler,
        on_exhausted: Callable[[], object],
    ) -> None:
        self.name = name
        self.exhausted_total = 0
        self._listener = listener
        self._handle = handle
        self._on_exhausted = on_exhausted

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        pause = 0.0
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if exc.errno in GONE_ERRNOS:
                    continue
                pause = self._failed(exc, pause)
                await asyncio.sleep(pause)
                continue
            if pause:
                _log.warning("%s: accepting connections again", self.name)
                pause = 0.0
            self._dispatch(conn)
            await asyncio.sleep(0)  # accept() does not yield while connections queue up

    def _failed(self, exc: OSError, pause: float) -> float:
        """Frees a descriptor if that is what is missing, logs the first failure of an
        episode; returns the next pause. Other errors pause too: accepting must not stop."""
        exhausted = exc.errno in EXHAUSTED_ERRNOS
        if not pause:
            _log.warning(
                "%s: cannot accept a connection: %s; pausing%s",
                self.name,
                exc.strerror or exc,
                " and dropping the oldest connection (raise the descriptor limit, LimitNOFILE, "
                "if this is not a flood)"
                if exhausted
                else "",
            )
        if exhausted:
            self.exhausted_total += 1
            self._on_exhausted()
        return min(BACKOFF_MAX_SECONDS, max(BACKOFF_MIN_SECONDS, pause * 2))

    def _dispatch(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            self._handle(conn)
        except Exception:
            conn.close()
            _log.exception("%s: handling a new connection failed", self.name)
