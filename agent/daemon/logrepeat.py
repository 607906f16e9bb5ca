"""`RepeatFilter`: one log line per kind per window, however often it repeats.

A flood (connections, malformed messages) must not turn the agent's log into the flood's copy:
issue #13 saw 110 MB of one line in 35 s. Lines of the same kind (logger, level and message
template, before its arguments are filled in) pass once per window; the next one to pass says
how many were left out before it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

WINDOW_SECONDS = 10.0
MAX_KINDS = 4096

_Kind = tuple[str, int, str]


@dataclass
class _Seen:
    since: float
    suppressed: int = 0


class RepeatFilter(logging.Filter):
    """Attach to a handler. Not thread-safe on its own: logging calls filters under the
    handler's lock. Memory is bounded: past MAX_KINDS kinds, the table starts afresh."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS) -> None:
        super().__init__()
        self.window_seconds = window_seconds
        self._seen: dict[_Kind, _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        seen = self._seen.get(kind)
        if seen is not None and now - seen.since < self.window_seconds:
            seen.suppressed += 1
            return False
        if len(self._seen) >= MAX_KINDS:
            self._seen.clear()
        self._seen[kind] = _Seen(now)
        if seen is not None and seen.suppressed:
            record.msg = (
                f"{record.msg} [and {seen.suppressed} more like it since the last one logged]"
            )
        return True
