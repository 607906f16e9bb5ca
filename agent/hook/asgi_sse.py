"""Server-sent events as the ASGI middleware reads a streaming response: which events are tokens.

A response body is read as the SSE format defines it (the WHATWG HTML standard, "Server-sent
events"): lines end with CRLF, LF or CR; a line starting with ':' is a comment; a blank line
ends an event; an event is dispatched only if it has a `data` field. So comments (sse-starlette's
`: ping` keep-alives, sent while llama-cpp-python's request waits for its generation lock),
blank lines and events without data are never events here, and never tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# What is kept of one line, and of one event's data: enough for any engine's first chunk.
MAX_KEPT_BYTES = 64 * 1024
DONE = b"[DONE]"  # OpenAI-style streams end with it: an event, not a token
LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True)
class DataEvent:
    """One dispatched event: its `id` field and its data (lines joined by LF), each at most
    MAX_KEPT_BYTES (a longer value is cut)."""

    event_id: bytes
    data: bytes

    @property
    def is_done(self) -> bool:
        return self.data.strip() == DONE

    def request_id(self) -> str | None:
        """The engine's id for the request: the event's `id` field, else the "id" of its JSON
        data (OpenAI-style chunks: "cmpl-…", "chatcmpl-…"); None if it has neither."""
        if self.event_id:
            return self.event_id.decode("utf-8", "replace")
        try:
            parsed = json.loads(self.data)
        except (ValueError, RecursionError):  # not JSON (or cut); UnicodeDecodeError included
            return None
        if isinstance(parsed, dict) and isinstance(parsed.get("id"), str) and parsed["id"]:
            return str(parsed["id"])
        return None


class EventReader:
    """Reads a response body in whatever pieces it is sent and returns its data events.

    Invariants: the events returned do not depend on how the body is split; a line longer
    than MAX_KEPT_BYTES is read as its first MAX_KEPT_BYTES, and at most that much of an
    unfinished line and of an event's data is held.
    """

    def __init__(self) -> None:
        self._rest = b""  # the line not ended yet
        self._after_cr = False  # the last body ended with a CR: an LF first is its CRLF's half
        self._data: bytes | None = None  # the current event's data; None: no data field yet
        self._event_id = b""

    def feed(self, body: bytes) -> list[DataEvent]:
        """The events that `body` completes, in order."""
        if not body:
            return []
        if self._after_cr:
            body = body.removeprefix(b"\n")
        if len(self._rest) == MAX_KEPT_BYTES:  # an overlong line: the rest of it is dropped
            body = body[_line_end(body) :]
        text = self._rest + body
        events: list[DataEvent] = []
        start = 0
        for end in LINE_END.finditer(text):
            event = self._line(text[start : end.start()])
            if event is not None:
                events.append(event)
            start = end.end()
        self._rest = text[start:][:MAX_KEPT_BYTES]  # a longer line keeps its start (its field)
        self._after_cr = text.endswith(b"\r")
        return events

    def _line(self, line: bytes) -> DataEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(b":"):
            return None  # a comment
        field, colon, value = line.partition(b":")
        if colon:
            value = value.removeprefix(b" ")
        if field == b"data":
            joined = value if self._data is None else self._data + b"\n" + value
            self._data = joined[:MAX_KEPT_BYTES]
        elif field == b"id":
            self._event_id = value[:MAX_KEPT_BYTES]
        return None

    def _dispatch(self) -> DataEvent | None:
        """A blank line ends the event; one without data (or a lone blank line) is nothing."""
        data, event_id = self._data, self._event_id
        self._data, self._event_id = None, b""
        if data is None:
            return None
        return DataEvent(event_id, data)


def _line_end(body: bytes) -> int:
    found = LINE_END.search(body)
    return len(body) if found is None else found.start()
