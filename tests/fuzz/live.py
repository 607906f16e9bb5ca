"""A live HookServer on its own event-loop thread, fed whole connections' worth of bytes, and
what its counters must say afterwards (the expectation is computed with the codec itself)."""

from __future__ import annotations

import contextlib
import socket
from collections import Counter
from collections.abc import Iterable

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.protocol import (
    MESSAGE_TYPES,
    Answer,
    Close,
    EngineInfo,
    LineFramer,
    Open,
    Resumed,
    UnsupportedVersionError,
    Update,
)
from kvwatch.lab.agent_thread import HookServerThread

# One of these counts goes up for every non-empty line the server reads.
PER_LINE_COUNTERS = (
    "malformed_messages",
    "hellos",
    "before_hello_messages",
    "opens",
    "updates",
    "closes",
    "resumes",
    *(
        f"unmatched_{cls.COMMAND}_answers"
        for cls in MESSAGE_TYPES.values()
        if issubclass(cls, Answer)
    ),
)
SESSION_SECONDS = 30.0


def expected_counts(chunks: Iterable[bytes]) -> Counter[str]:
    """What one connection sending `chunks` (then closing) adds to PER_LINE_COUNTERS."""
    framer = LineFramer(sender="engine")
    counts: Counter[str] = Counter()
    said_hello = False
    for chunk in chunks:
        for item in framer.feed(chunk):
            if isinstance(item, ProtocolError):
                counts["malformed_messages"] += 1
                if isinstance(item, UnsupportedVersionError) and not said_hello:
                    return counts  # refused: the server reads no further
            elif isinstance(item, EngineInfo):
                counts["hellos"] += 1
                said_hello = True
            elif not said_hello:
                counts["before_hello_messages"] += 1
            elif isinstance(item, Answer):  # nobody asked: no command was sent
                counts[f"unmatched_{item.COMMAND}_answers"] += 1
            else:
                kinds = {Open: "opens", Update: "updates", Close: "closes", Resumed: "resumes"}
                counts[kinds[type(item)]] += 1
    return counts


class LiveServer(HookServerThread):
    """A HookServer on its own loop thread that fuzz sessions are fed to."""

    def counters(self) -> dict[str, int]:
        async def read() -> dict[str, int]:
            return self.server.counters()

        return self.call(read())

    def held(self) -> tuple[int, int]:
        """(connections, live streams) the server holds now."""

        async def read() -> tuple[int, int]:
            return self.server.connection_count(), len(self.server.streams())

        return self.call(read())

    def session(self, chunks: Iterable[bytes]) -> None:
        """Connects, writes each chunk, closes its sending side, reads until the server closes."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(SESSION_SECONDS)
            sock.connect(self.path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for chunk in chunks:
                    sock.sendall(chunk)
                sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(65536):
                    pass

    def check_session(self, chunks: list[bytes]) -> Counter[str]:
        """Runs a session and asserts the counters moved exactly as the codec says they must
        and that nothing is left held; returns the expected counts."""
        before = self.counters()
        self.session(chunks)
        expected = expected_counts(chunks)
        after = self.counters()
        moved = {name: after[name] - before[name] for name in PER_LINE_COUNTERS}
        assert moved == {name: expected[name] for name in PER_LINE_COUNTERS}, (moved, expected)
        assert after["internal_errors"] == 0
        assert after["disconnects"] - before["disconnects"] == 1
        assert self.held() == (0, 0)
        return expected
