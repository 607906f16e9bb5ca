"""The middleware's SSE reader on sse-starlette's own encoding, in each line end it offers:
comments, keep-alives and events without data are not events; data events are read whole
however the body is split; the request id comes from the event's id field or its JSON."""

from __future__ import annotations

import json
import random

import pytest
from sse_starlette.event import ServerSentEvent

from kvwatch.hook.asgi_sse import MAX_KEPT_BYTES, DataEvent, EventReader

SEPARATORS = ("\r\n", "\n", "\r")


def _stream(sep: str) -> bytes:
    """What a waiting request's response carries: pings, a blank keep-alive, an event with an
    id but no data, then two chunks (a multi-line one) and `[DONE]`, pings between them."""
    chunk = json.dumps({"id": "cmpl-7", "choices": [{"text": " hi"}]})
    events = [
        ServerSentEvent(comment="ping - 2025-01-01 00:00:00", sep=sep),
        ServerSentEvent(comment="ping - 2025-01-01 00:00:15", sep=sep),
        ServerSentEvent(id="not-a-token", retry=1000, sep=sep),
        ServerSentEvent(data=chunk, sep=sep),
        ServerSentEvent(comment="ping - 2025-01-01 00:00:30", sep=sep),
        ServerSentEvent(data='{"id": "cmpl-7",\n"choices": []}', sep=sep),
        ServerSentEvent(data="[DONE]", sep=sep),
    ]
    return sep.encode().join([b"", *(event.encode() for event in events)])


def _read_in_pieces(body: bytes, sizes: list[int]) -> list[DataEvent]:
    reader, events, start = EventReader(), [], 0
    for size in sizes:
        events += reader.feed(body[start : start + size])
        start += size
    return events + reader.feed(body[start:])


@pytest.mark.parametrize("sep", SEPARATORS)
def test_only_events_with_data_are_read_however_the_body_is_split(sep: str) -> None:
    body = _stream(sep)
    whole = EventReader().feed(body)
    assert [event.request_id() for event in whole] == ["cmpl-7", "cmpl-7", None]
    assert [event.is_done for event in whole] == [False, False, True]
    assert whole[1].data == b'{"id": "cmpl-7",\n"choices": []}'
    assert _read_in_pieces(body, [1] * len(body)) == whole
    pieces = random.Random(7)
    for _ in range(50):
        sizes = [pieces.randint(0, 40) for _ in range(len(body) // 10)]
        assert _read_in_pieces(body, sizes) == whole


def test_comments_and_keep_alives_alone_are_never_events() -> None:
    reader = EventReader()
    for _ in range(100):
        assert reader.feed(b": ping - 2025-01-01\r\n\r\n") == []
        assert reader.feed(b"") == []  # llama-cpp-python's ping when pings are "disabled"
        assert reader.feed(b"\n\n\r\n") == []
        assert reader.feed(b"event: keepalive\nid: 9\n\n") == []
    assert reader.feed(b"data: {}\n\n") == [DataEvent(b"", b"{}")]


def test_the_request_id_is_the_id_field_else_the_data_json_id() -> None:
    assert DataEvent(b"ev-1", b'{"id": "cmpl-2"}').request_id() == "ev-1"
    assert DataEvent(b"", b'{"id": "chatcmpl-3", "object": "x"}').request_id() == "chatcmpl-3"
    for data in (b'{"object": "x"}', b'{"id": 5}', b'{"id": ""}', b'["cmpl-4"]', b"hello"):
        assert DataEvent(b"", data).request_id() is None, data
    assert DataEvent(b"", b'{"id": "cmpl-\xff"}').request_id() is None  # not UTF-8
    assert DataEvent(b"", b"[" * 100_000).request_id() is None  # nested past the recursion limit


def test_an_overlong_line_is_cut_and_the_events_after_it_are_read() -> None:
    reader = EventReader()
    head = b'data: {"id": "cmpl-big", "pad": "'
    events = reader.feed(head)
    for _ in range(256):  # 1 MiB of one line, in 4 KiB pieces
        events += reader.feed(b"x" * 4096)
    events += reader.feed(b'"}\n\ndata: {"id": "cmpl-next"}\n\n')
    assert len(events) == 2
    assert events[0].data == (head + b"x" * MAX_KEPT_BYTES)[len(b"data: ") : MAX_KEPT_BYTES]
    assert events[0].request_id() is None  # cut: not JSON any more
    assert events[1].request_id() == "cmpl-next"
