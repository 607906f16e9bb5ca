"""The codec under arbitrary input: every line decodes to a message or raises ProtocolError
(never anything else), what decodes re-encodes to the same message, and the framer gives the
same answers however the bytes are split."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.protocol import MAX_NESTING, LineFramer, Message, decode, encode
from tests.fuzz.conftest import fuzz_settings, json_values, message_bodies


def _lines(body: Any) -> list[bytes]:
    """`body` as an escaped line and as raw text (lone surrogates become invalid UTF-8)."""
    escaped = json.dumps(body).encode()
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return [escaped, raw]


def _decoded(line: bytes) -> Message | None:
    try:
        message = decode(line)
    except ProtocolError:
        return None
    assert decode(encode(message)) == message
    for value in vars(message).values():
        if isinstance(value, str):
            value.encode()  # only real text gets through
    return message


@fuzz_settings(0.25)
@given(message_bodies())
def test_near_messages_decode_or_are_refused(body: dict[str, Any]) -> None:
    for line in _lines(body):
        _decoded(line)


@fuzz_settings(0.1)
@given(json_values)
def test_any_json_value_decodes_or_is_refused(value: Any) -> None:
    for line in _lines(value):
        _decoded(line)


@fuzz_settings(0.1)
@given(st.binary(max_size=200), message_bodies())
def test_arbitrary_bytes_and_spliced_lines_decode_or_are_refused(
    noise: bytes, body: dict[str, Any]
) -> None:
    line = json.dumps(body).encode()
    _decoded(noise)
    _decoded(line[: len(noise) % (len(line) + 1)] + noise)


@fuzz_settings(0.05)
@given(st.integers(MAX_NESTING + 1, 40_000), st.sampled_from([b"[]", b"{}"]))
def test_deep_nesting_is_malformed_at_any_depth(depth: int, brackets: bytes) -> None:
    opener = b"[" if brackets == b"[]" else b'{"a":'
    inner = opener * depth + b"1" + brackets[1:] * depth
    line = b'{"v":1,"type":"close","request_id":"r","reason":"x","extra":' + inner + b"}"
    assert _decoded(line) is None


@fuzz_settings(0.05)
@given(st.lists(message_bodies(), min_size=1, max_size=6), st.data())
def test_framer_answers_do_not_depend_on_how_bytes_are_split(
    bodies: list[dict[str, Any]], data: st.DataObject
) -> None:
    stream = b"".join(_lines(body)[data.draw(st.integers(0, 1))] + b"\n" for body in bodies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    framer = LineFramer(sender="engine")
    results: list[Message | ProtocolError] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        results += framer.feed(stream[start:end])
    whole = LineFramer(sender="engine").feed(stream)
    assert [_kind(item) for item in results] == [_kind(item) for item in whole]
    assert len(results) == len(bodies)


def _kind(item: Message | ProtocolError) -> object:
    return item if isinstance(item, Message) else type(item)
