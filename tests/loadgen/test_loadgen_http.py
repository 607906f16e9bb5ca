"""The load generator's incremental HTTP/1.1 and SSE parsers, fed byte by byte."""

from __future__ import annotations

import pytest

from kvwatch.errors import ConfigError
from kvwatch.lab.loadgen.http import ResponseError, ResponseParser, SseParser, Target, parse_chunk

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"7\r\ndata: a\r\n"
    b"b;ext=1\r\n\ndata: bc\n\n\r\n"
    b"0\r\nX-Trailer: 1\r\n\r\n"
)


def _feed_bytewise(parser: ResponseParser, data: bytes) -> bytes:
    return b"".join(parser.feed(data[i : i + 1]) for i in range(len(data)))


def test_chunked_body_split_anywhere() -> None:
    parser = ResponseParser()
    assert _feed_bytewise(parser, CHUNKED) == b"data: a\ndata: bc\n\n"
    assert parser.complete
    assert parser.status == 200
    assert parser.headers["content-type"] == "text/event-stream"


def test_sized_and_close_delimited_bodies() -> None:
    sized = ResponseParser()
    assert sized.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhello extra") == b"hello"
    assert sized.complete and sized.status == 404
    until_close = ResponseParser()
    assert _feed_bytewise(until_close, b"HTTP/1.0 200 OK\r\n\r\nabc") == b"abc"
    assert not until_close.complete
    until_close.eof()
    assert until_close.complete


@pytest.mark.parametrize(
    "data",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
    ],
)
def test_broken_responses_raise(data: bytes) -> None:
    with pytest.raises(ResponseError):
        ResponseParser().feed(data)


def test_sse_events_with_crlf_comments_and_multiline_data() -> None:
    parser = SseParser()
    stream = (
        b": keepalive\r\n\r\ndata: one\r\n\r\ndata:two\ndata: three\nevent: x\n\ndata: [DONE]\n\n"
    )
    events = [event for i in range(len(stream)) for event in parser.feed(stream[i : i + 1])]
    assert events == ["one", "two\nthree", "[DONE]"]


def test_chunk_text_for_both_endpoints() -> None:
    assert parse_chunk('{"choices": [{"text": "hi", "finish_reason": null}]}', "completions") == (
        "hi",
        None,
    )
    chat = '{"choices": [{"delta": {"content": "yo"}, "finish_reason": "stop"}]}'
    assert parse_chunk(chat, "chat") == ("yo", "stop")
    assert parse_chunk('{"choices": [{"delta": {"role": "assistant"}}]}', "chat") == ("", None)
    assert parse_chunk('{"choices": [], "usage": {"completion_tokens": 3}}', "chat") == ("", None)
    with pytest.raises(ResponseError, match="server error in stream"):
        parse_chunk('{"error": {"message": "boom"}}', "chat")
    with pytest.raises(ResponseError, match="not JSON"):
        parse_chunk("{", "chat")


def test_targets() -> None:
    assert Target.parse("http://h:1").api_prefix == "/v1"
    assert Target.parse("http://h:1/v1/").api_prefix == "/v1"
    assert Target.parse("http://h/api").path("chat") == "/api/v1/chat/completions"
    assert Target.parse("http://h/api").port == 80
    assert Target.parse("http://[::1]:8000").host_header == "[::1]:8000"
    for url in ("https://h:1", "h:1", "http://h:x"):
        with pytest.raises(ConfigError):
            Target.parse(url)
