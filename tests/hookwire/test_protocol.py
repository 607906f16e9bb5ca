"""The engine-hook wire codec: round trips, strict validation, framing."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.protocol import (
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Cancelled,
    Close,
    Detach,
    Detached,
    EngineInfo,
    ErrorMessage,
    LineFramer,
    Message,
    Open,
    Update,
    Welcome,
    decode,
    encode,
    plural,
)
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.sockets import Endpoint

EVERY_MESSAGE: list[Message] = [
    EngineInfo(
        engine="kvwatch-reference",
        model="tiny",
        pid=123,
        bytes_per_block=16384,
        device="cuda:0",
        kv_blocks_total=512,
    ),
    Welcome(agent="kvwatch 0.1.0"),
    ErrorMessage(message="uid 1001 is not allowed", hint="add it to engine_uids"),
    Open(
        request_id="cmpl-1",
        local=Endpoint("10.0.0.1", 8000),
        remote=Endpoint("2001:db8::7", 50123),
        pid=123,
        kv_blocks=7,
        bytes_per_block=16384,
        device="cpu",
        tokens_out=3,
    ),
    Update(request_id="cmpl-1", kv_blocks=8, tokens_out=40),
    Close(request_id="cmpl-1", reason="finished"),
    Detach(request_id="cmpl-1", reason="backpressure", correlation_id="d-3"),
    Detached(
        request_id="cmpl-1",
        status="detached",
        freed_blocks=0,
        freed_bytes=0,
        correlation_id="d-3",
        buffered_bytes=312,
    ),
    Cancel(
        request_id="cmpl-1",
        reason="stalled",
        correlation_id="c-17",
        evidence={"no_progress_seconds": 3.2, "peer_rwnd": 0, "zero_window": True},
    ),
    Cancelled(
        request_id="cmpl-1",
        status="cancelled",
        freed_blocks=8,
        freed_bytes=131072,
        correlation_id="c-17",
        detail="",
    ),
]


def _line(**body: Any) -> bytes:
    return json.dumps(body).encode() + b"\n"


def _open_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": "open",
        "request_id": "r1",
        "local": "127.0.0.1:8000",
        "remote": "127.0.0.1:40000",
        "pid": 1,
        "kv_blocks": 2,
        "bytes_per_block": 64,
        "device": "cpu",
    }
    body.update(changes)
    return {key: value for key, value in body.items() if value is not None}


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: m.TYPE)
def test_every_message_round_trips_as_one_line(message: Message) -> None:
    line = encode(message)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert json.loads(line)["v"] == PROTOCOL_VERSION
    assert decode(line) == message
    assert decode(line.decode(), sender=message.SENDER) == message


def test_optional_estimate_and_buffer_fields_default_off_and_round_trip() -> None:
    old_peer = decode(_line(**_open_body()))
    assert isinstance(old_peer, Open) and old_peer.kv_estimated is False
    update = Update(
        request_id="r", kv_blocks=1, tokens_out=2, kv_estimated=True, egress_buffer_full=True
    )
    assert decode(encode(update)) == update
    body = json.loads(encode(update))
    assert (body["kv_estimated"], body["egress_buffer_full"]) == (True, True)
    with pytest.raises(ProtocolError, match="'kv_estimated' must be true or false"):
        decode(_line(**_open_body(kv_estimated=1)))


def test_a_detach_answer_and_its_outcome_carry_the_buffered_bytes() -> None:
    outcome = CommandOutcome("cmpl-1", "detached", 0, 0, "", buffered_bytes=312)
    answer = Detached.of(outcome, "d-3")
    assert answer == EVERY_MESSAGE[7]
    assert answer.outcome() == outcome
    old_peer = json.loads(encode(answer))
    del old_peer["buffered_bytes"]
    assert decode(_line(**old_peer)) == Detached.of(
        dataclasses.replace(outcome, buffered_bytes=0), "d-3"
    )
    # A cancel's answer has no such field: it is left out, not refused.
    cancelled = Cancelled.of(dataclasses.replace(outcome, status="cancelled"), "c-1")
    assert cancelled.outcome() == CommandOutcome("cmpl-1", "cancelled", 0, 0, "")
    reannounced = decode(_line(**_open_body(detached=True)))
    assert isinstance(reannounced, Open) and reannounced.detached
    assert [plural(kind) for kind in ("cancel", "park", "detach")] == [
        "cancels",
        "parks",
        "detaches",
    ]


def test_endpoints_are_ip_port_strings_with_ipv6_in_brackets() -> None:
    body = json.loads(encode(EVERY_MESSAGE[3]))
    assert body["local"] == "10.0.0.1:8000"
    assert body["remote"] == "[2001:db8::7]:50123"


def test_newlines_inside_strings_stay_on_one_line() -> None:
    line = encode(Close(request_id="r\n1", reason="a\nb"))
    assert line.count(b"\n") == 1
    assert decode(line) == Close(request_id="r\n1", reason="a\nb")


def test_unknown_fields_are_ignored() -> None:
    message = decode(_line(**_open_body(priority=5, future={"x": 1})))
    assert isinstance(message, Open)
    assert message.kv_blocks == 2
    assert message.tokens_out == 0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"not json\n", "not a line of UTF-8 JSON"),
        (b"\xff\xfe{}\n", "not a line of UTF-8 JSON"),
        (b"[1, 2]\n", "must be a JSON object"),
        (_line(type="open"), "no protocol version"),
        (_line(**_open_body(v=2)), "protocol version 2 is not supported"),
        (_line(**_open_body(v="1")), "protocol version '1' is not supported"),
        (_line(**_open_body(type="teleport")), "unknown message type 'teleport'"),
        (_line(**_open_body(kv_blocks=None)), "lacks required field 'kv_blocks'"),
        (_line(**_open_body(kv_blocks="3")), "field 'kv_blocks' must be a non-negative integer"),
        (_line(**_open_body(kv_blocks=-1)), "field 'kv_blocks' must be a non-negative integer"),
        (_line(**_open_body(pid=True)), "field 'pid' must be a non-negative integer"),
        (_line(**_open_body(kv_blocks=2.5)), "field 'kv_blocks' must be a non-negative integer"),
        (_line(**_open_body(device=7)), "field 'device' must be a string"),
        (_line(**_open_body(request_id="")), "field 'request_id' must be a non-empty string"),
        (_line(**_open_body(request_id="x" * 300)), "at most 256 characters"),
        (_line(**_open_body(remote="localhost:80")), "field 'remote' must be an \"ip:port\""),
        (_line(**_open_body(local=8000)), "field 'local' must be an \"ip:port\""),
        (b'{"v": 1, "type": "update", "request_id": "r", "kv_blocks": NaN}\n', "NaN"),
        (_line(**_open_body(device="\ud800")), "not Unicode text"),
        (_line(**_open_body(request_id="a\udfff")), "not Unicode text"),
        (_line(**_open_body(extra={"\udc80": 1})), "not Unicode text"),
        (b'{"v":1,"type":"close","request_id":"r","reason":"\xed\xa0\x80"}', "not Unicode text"),
        (_line(**_open_body(extra=[[[[1]]]])), "deeper than 4 levels"),
        (b"[" * 30_000 + b"]" * 30_000 + b"\n", "deeper than 4 levels"),
        (b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"\n", "deeper than 4 levels"),
    ],
)
def test_malformed_lines_raise_a_helpful_protocol_error(line: bytes, expected: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(line)
    assert expected in str(caught.value)
    assert caught.value.hint


def test_nesting_up_to_the_limit_is_accepted() -> None:
    message = decode(_line(**_open_body(extra=[[1, {"k": "v"}]])))
    assert isinstance(message, Open)


def test_unknown_version_says_what_to_do() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(_line(**_open_body(v=2)))
    assert "this side speaks version 1" in caught.value.message
    assert "same kvwatch version" in caught.value.hint


def test_wrong_status_and_wrong_evidence_are_refused() -> None:
    body = json.loads(encode(EVERY_MESSAGE[-1]))
    with pytest.raises(ProtocolError, match="status 'gone'"):
        decode(_line(**{**body, "status": "gone"}))
    cancel = json.loads(encode(EVERY_MESSAGE[-2]))
    with pytest.raises(ProtocolError, match="'evidence' must be a JSON object"):
        decode(_line(**{**cancel, "evidence": [1]}))


def test_sender_direction_is_enforced() -> None:
    with pytest.raises(ProtocolError, match="sent by the agent, but this came from the engine"):
        decode(encode(EVERY_MESSAGE[-2]), sender="engine")
    with pytest.raises(ProtocolError, match="sent by the engine, but this came from the agent"):
        decode(encode(EVERY_MESSAGE[0]), sender="agent")


def test_oversized_lines_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError, match="byte line limit"):
        decode(b" " * MAX_LINE_BYTES + encode(EVERY_MESSAGE[1]))
    huge = Cancel(request_id="r", reason="x", correlation_id="c", evidence={"a": "y" * 70000})
    with pytest.raises(ProtocolError, match="over the 65536 byte limit"):
        encode(huge)
    with pytest.raises(ProtocolError, match="cannot be encoded as JSON"):
        encode(Cancel(request_id="r", reason="x", correlation_id="c", evidence={"a": {1, 2}}))


def test_invalid_messages_cannot_be_built() -> None:
    with pytest.raises(ProtocolError, match="'freed_blocks' must be a non-negative integer"):
        Cancelled(
            request_id="r", status="failed", freed_blocks=-1, freed_bytes=0, correlation_id="c"
        )


def test_framer_splits_joins_and_recovers_from_oversized_lines() -> None:
    framer = LineFramer(sender="engine")
    first, second = encode(EVERY_MESSAGE[4]), encode(EVERY_MESSAGE[5])
    assert framer.feed(first[:10]) == []
    assert framer.feed(first[10:] + b"\n\n" + second) == [EVERY_MESSAGE[4], EVERY_MESSAGE[5]]
    results = framer.feed(b"x" * (MAX_LINE_BYTES + 1))
    assert len(results) == 1
    assert isinstance(results[0], ProtocolError)
    assert framer.feed(b"y" * MAX_LINE_BYTES) == []  # still the same oversized line
    assert framer.feed(b"z\n" + first) == [EVERY_MESSAGE[4]]
    garbage = framer.feed(b"{oops}\n" + encode(EVERY_MESSAGE[1]))
    assert [type(item) for item in garbage] == [ProtocolError, ProtocolError]


@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        assert isinstance(decode(data), Message)


@given(
    st.dictionaries(
        st.sampled_from(["v", "type", "request_id", "kv_blocks", "tokens_out", "reason"]),
        st.one_of(
            st.integers(-2, 2),
            st.sampled_from(["update", "close", "r1", ""]),
            st.none(),
            st.booleans(),
        ),
    )
)
def test_arbitrary_objects_decode_or_raise_protocol_error(body: dict[str, Any]) -> None:
    with contextlib.suppress(ProtocolError):
        assert isinstance(decode(json.dumps(body)), Message)
