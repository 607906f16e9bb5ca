"""Coalesced egress of the reference engine over real HTTP (kvwatch.hook.asgi_coalesce): the
stream's bytes are those of an uncoalesced one, written in chunks of about `coalesce_bytes`;
the first token is written at once; what gathered is written `coalesce_ms` after its first
token even when no more comes (a paused request); and the writer keeps taking tokens while it
gathers them, so a healthy reader never holds a coupled request."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvwatch.lab.engine.engine_server import EngineServer
from kvwatch.lab.http_chunks import ChunkedResponse, without_created
from kvwatch.lab.waiting import wait_for, wait_until

pytestmark = pytest.mark.engine

WAIT_SECONDS = 20.0
MAX_TOKENS = 200


def stream(server: EngineServer, request_id: str, max_tokens: int = MAX_TOKENS) -> ChunkedResponse:
    body = json.dumps({"prompt": "coalesce", "max_tokens": max_tokens, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nX-Request-Id: {request_id}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(server.address)
    sock.sendall(head + body)
    return ChunkedResponse(sock).start()


def read_whole(response: ChunkedResponse) -> ChunkedResponse:
    assert response.ended.wait(WAIT_SECONDS), "the response never ended"
    response.sock.close()
    assert response.body.endswith(b"data: [DONE]\n\n")
    return response


def paused_report(server: EngineServer, request_id: str) -> dict[str, Any] | None:
    """The request's GET /v1/requests/{id} report once it shows it paused, else None."""
    report: dict[str, Any] = httpx.get(f"{server.url}/v1/requests/{request_id}").json()
    return report if report["state"] == "paused" else None


def test_coalesced_writes_carry_the_same_bytes_in_bounded_chunks_the_first_token_alone(
    make_server: Callable[..., EngineServer],
) -> None:
    plain = read_whole(stream(make_server(coalesce_bytes=0), "c"))
    coalesced = read_whole(stream(make_server(), "c"))  # 1024 bytes or 100 ms

    assert without_created(coalesced.body) == without_created(plain.body)
    assert coalesced.chunks[0].count(b"data: ") <= 4  # the first batch, written at once
    event_bytes = max(len(event) + 2 for event in plain.body.split(b"\n\n"))
    batch_bytes = 4 * event_bytes  # the coupled queue's 4 tokens: what one batch may add
    assert max(len(chunk) for chunk in coalesced.chunks[1:-1]) < 1024 + batch_bytes
    assert len(coalesced.chunks) < len(plain.chunks) / 3


def test_the_writer_keeps_taking_tokens_while_it_gathers_them(
    make_server: Callable[..., EngineServer],
) -> None:
    # Nothing is written between the first batch and the end: were the writer to stop taking
    # tokens while it gathers, the coupled request would wait a minute on its full queue. And
    # the first batch did not wait for the others.
    server = make_server(coalesce_bytes=1 << 20, coalesce_ms=60_000)
    response = read_whole(stream(server, "taking"))
    assert len(response.chunks) == 2
    assert response.body.count(b"data: {") == MAX_TOKENS + 1  # and the finish chunk


def test_what_gathered_is_written_after_coalesce_ms_when_no_more_comes(
    make_server: Callable[..., EngineServer],
) -> None:
    server = make_server(coalesce_bytes=1 << 20, coalesce_ms=50)
    response = stream(server, "paused", max_tokens=2000)
    wait_until(lambda: len(response.events()) >= 20, WAIT_SECONDS, "20 tokens")
    assert server.engine.pause("cmpl-paused", "test").status == "paused"
    report = wait_for(
        lambda: paused_report(server, "cmpl-paused"), WAIT_SECONDS, "the paused state shown"
    )

    # Paused, it generates nothing more: each token it did arrives once coalesce_ms passed.
    wait_until(
        lambda: len(response.events()) == report["tokens_generated"],
        WAIT_SECONDS,
        lambda: f"{report['tokens_generated']} tokens (got {len(response.events())})",
    )
    assert server.engine.cancel("cmpl-paused", "test").status == "cancelled"
    response.sock.close()
