"""Detach in the ASGI middleware (docs/protocol.md, "Detach"): llama-cpp-python's real server
in this process under uvicorn and hypercorn, kvwatch's real HookServer as the agent, clients
with the kernel's default receive buffer. A client that stops reading holds the one
generation lock; detached, its stream generates to its end, the lock goes to the request
waiting for it, and the client still gets every byte, in order; cancelled, the buffer is
dropped and the client reset. With no agent, nothing detaches. (The buffers' caps:
test_asgi_detach_buffers.py.)"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest

from kvwatch.lab.agent_thread import HookServerThread
from kvwatch.lab.asgi_servers import open_client, read_all, read_until
from kvwatch.lab.http_chunks import dechunked
from kvwatch.lab.llama_servers import MODEL, llama_completion, serving_llama
from kvwatch.lab.tiny_gguf import write_tiny_llama
from kvwatch.lab.waiting import wait_for, wait_until
from tests.e2e.llama_required import require_llama_cpp

require_llama_cpp()
pytestmark = pytest.mark.slow

SERVERS = ("uvicorn", "hypercorn")
# About 235 bytes a chunk: the client's and the server's buffers take some 1500 chunks.
LONG_TOKENS = 3000
SLOW_TOKENS = 2400
WAITER_TOKENS = 20
WAIT_SECONDS = 60.0  # a loaded 2-core CI machine: a hypercorn stream took 46 s
# A bound on a whole generation of LONG_TOKENS: ~20 s alone, over 60 s in the parallel suite.
GENERATION_SECONDS = 180.0
SLOW_READ_BYTES = 8192
# At most 16 KB/s until the generation has ended, then as fast as it comes. The tiny model's
# 2400 tokens (~610 KB) took 17-20 s on a loaded 2-core machine (30-36 KB/s), 58 s (10.5 KB/s)
# in the parallel suite: a reader that keeps up with the stream gets its close with no update
# saying the KV was freed (the hook coalesces that update into the close), and the test waited
# for an update that could not come (hypercorn's stream, which was taken for slow). The reader
# goes at a third of this machine's undetached pace at most, so it cannot catch up.
SLOW_READ_PAUSE_SECONDS = 0.5
ENGINE_PER_REQUEST = re.compile(rb'"id": "cmpl-[0-9a-f-]+"|"created": \d+')
# sse-starlette (llama-cpp-python's SSE) writes a comment every 15 s: a stream read slowly has
# some, a fast one none. Comments carry nothing of the stream (the SSE spec drops them).
SSE_COMMENT = re.compile(rb"^:[^\r\n]*\r?\n\r?\n", re.MULTILINE)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("detach") / "tiny.gguf", MODEL)


def _generation_ended(
    hook_server: HookServerThread, request_id: str, timeout_seconds: float = GENERATION_SECONDS
) -> float:
    """When the app returned (monotonic s): an update said the request's KV was freed. The
    hook server notes it as it comes, so a stream that closes at once is not missed."""
    return wait_for(
        lambda: hook_server.kv_freed_at.get(request_id),
        timeout_seconds,
        f"the end of {request_id}'s generation",
    )


def _chunks(body: bytes) -> int:
    return body.count(b"data: {")


def _complete(body: bytes, tokens: int) -> bool:
    """Every chunk (one per token and the last, with the finish reason), [DONE], and the end
    of the chunked body."""
    return _chunks(body) == tokens + 1 and b"data: [DONE]" in body and body.endswith(b"0\r\n\r\n")


def _headers(client: socket.socket) -> bytes:
    return read_until(client, lambda data: b"\r\n\r\n" in data)


def _nothing_for(client: socket.socket, seconds: float) -> bytes:
    """What the client receives within `seconds` (a window in which nothing should come)."""
    client.settimeout(seconds)
    try:
        return client.recv(65536)
    except TimeoutError:
        return b""
    finally:
        client.settimeout(None)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_detached_stream_generates_to_its_end_and_the_waiting_request_is_served(
    kind: str, model_path: Path, socket_path: str, hook_server: HookServerThread
) -> None:
    with serving_llama(kind, model_path, socket_path) as (server, middleware):
        stalled = open_client(server.port, llama_completion(server.port, LONG_TOKENS))
        (held,) = hook_server.backed_up()
        waiter = open_client(server.port, llama_completion(server.port, WAITER_TOKENS))
        _headers(waiter)
        waited = _nothing_for(waiter, 1.0)  # it waits for the lock the stalled stream holds
        outcome = hook_server.command("detach", held.request_id)
        served = read_all(waiter, WAIT_SECONDS)
        _generation_ended(hook_server, held.request_id)
        detached = hook_server.stream(held.request_id)
        buffered = middleware.egress_budget.buffered_bytes  # the client has read nothing yet
        body = read_all(stalled, WAIT_SECONDS)
        wait_until(lambda: hook_server.stream(held.request_id) is None, WAIT_SECONDS, "its close")
        stalled.close()
        waiter.close()
    assert held.can_detach and not held.detached
    assert waited == b""
    assert (outcome.status, outcome.freed_blocks) == ("detached", 0)
    assert outcome.buffered_bytes > 0  # the send its generator was blocked in
    assert detached is not None and detached.detached
    assert _complete(served, WAITER_TOKENS)
    assert buffered > 0
    assert _complete(body, LONG_TOKENS)  # no cut: all of it, after the generation had ended
    assert middleware.egress_budget.buffered_bytes == 0
    assert middleware.egress_budget.peak_bytes <= 16 << 20


class _SlowReader(threading.Thread):
    """Reads a response SLOW_READ_BYTES at a time once `go` is set, pausing `pause_seconds`
    between reads until `hurry` is set."""

    def __init__(self, client: socket.socket, pause_seconds: float) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.pause_seconds = pause_seconds
        self.go = threading.Event()
        self.hurry = threading.Event()
        self.body = bytearray()
        self.progress: list[tuple[float, int]] = []  # (monotonic s, bytes read by then)

    def read_by(self, moment: float) -> int:
        """Bytes it had read at `moment`."""
        return max((count for at, count in self.progress if at <= moment), default=0)

    def run(self) -> None:
        self.go.wait(WAIT_SECONDS)
        self.client.settimeout(WAIT_SECONDS)
        while not self.body.endswith(b"0\r\n\r\n"):
            chunk = self.client.recv(SLOW_READ_BYTES)
            if not chunk:
                return
            self.body += chunk
            self.progress.append((time.monotonic(), len(self.body)))
            self.hurry.wait(self.pause_seconds)


def _http_body(response: bytes) -> bytes:
    """The body, its chunks joined (how it is cut into writes depends on timing: coalesced
    egress), its SSE comments dropped, and the two fields llama-cpp-python makes per request
    (id, created) blanked."""
    return ENGINE_PER_REQUEST.sub(b"x", SSE_COMMENT.sub(b"", dechunked(response)))


@pytest.mark.parametrize("kind", SERVERS)
def test_a_slow_reader_of_a_detached_stream_gets_the_undetached_stream_byte_for_byte(
    kind: str, model_path: Path, socket_path: str, hook_server: HookServerThread
) -> None:
    with serving_llama(kind, model_path, socket_path) as (server, _):
        request = llama_completion(server.port, SLOW_TOKENS, greedy=True)
        asked_at = time.monotonic()
        undetached = open_client(server.port, request)
        expected = _http_body(read_all(undetached, WAIT_SECONDS))
        undetached.close()
        # Detached, the generation runs as fast as undetached: a bound from this machine's pace,
        # and a reader at a third of that pace at most (SLOW_READ_PAUSE_SECONDS's comment).
        undetached_seconds = time.monotonic() - asked_at
        generation_bound = max(GENERATION_SECONDS, 3 * undetached_seconds)
        pause_seconds = max(
            SLOW_READ_PAUSE_SECONDS, 3 * SLOW_READ_BYTES * undetached_seconds / len(expected)
        )
        wait_until(lambda: hook_server.stream() is None, WAIT_SECONDS, "the first stream's close")
        reader = _SlowReader(open_client(server.port, request), pause_seconds)
        reader.start()
        (held,) = hook_server.backed_up()  # the reader has not started reading
        reader.go.set()
        outcome = hook_server.command("detach", held.request_id)
        generated_at = _generation_ended(hook_server, held.request_id, generation_bound)
        reader.hurry.set()
        reader.join(WAIT_SECONDS)
        read_when_generated = reader.read_by(generated_at)
        reader.client.close()
    assert outcome.status == "detached"
    assert _http_body(bytes(reader.body)) == expected
    assert _chunks(expected) == SLOW_TOKENS + 1
    assert read_when_generated < len(reader.body)  # the generation did not wait for it


@pytest.mark.parametrize("kind", SERVERS)
def test_a_detached_stream_whose_client_reads_no_more_is_cancelled_buffer_and_all(
    kind: str, model_path: Path, socket_path: str, hook_server: HookServerThread
) -> None:
    with serving_llama(kind, model_path, socket_path) as (server, middleware):
        gone = open_client(server.port, llama_completion(server.port, LONG_TOKENS))
        (held,) = hook_server.backed_up()
        detached = hook_server.command("detach", held.request_id)
        _generation_ended(hook_server, held.request_id)
        buffered = middleware.egress_budget.buffered_bytes
        again = hook_server.command("detach", held.request_id)
        cancelled = hook_server.command("cancel", held.request_id)
        wait_until(lambda: middleware.egress_budget.buffered_bytes == 0, WAIT_SECONDS, "no buffer")
        with pytest.raises(ConnectionResetError):
            gone.settimeout(WAIT_SECONDS)
            while gone.recv(65536):
                pass
        gone.close()
        wait_until(lambda: hook_server.stream() is None, WAIT_SECONDS, "its close")
    assert detached.status == "detached"
    assert buffered > 0
    assert (again.status, again.detail) == ("declined", "it is detached already")
    # The generation had ended; only its buffered output was left to drop.
    assert cancelled.status == "already_finished"


def test_with_no_agent_a_stalled_stream_stays_coupled(model_path: Path, socket_path: str) -> None:
    with serving_llama("uvicorn", model_path, socket_path) as (server, middleware):
        stalled = open_client(server.port, llama_completion(server.port, LONG_TOKENS))
        _headers(stalled)
        time.sleep(2.0)  # let the generation fill every buffer between it and the client
        waiter = open_client(server.port, llama_completion(server.port, WAITER_TOKENS))
        _headers(waiter)
        waited = _nothing_for(waiter, 2.0)  # nothing detaches: it waits for the lock
        stalled.close()  # unread data: a reset; the app's disconnect path releases the lock
        served = read_all(waiter, WAIT_SECONDS)
        waiter.close()
        assert middleware.hook is not None
        counters = middleware.hook.counters()
    assert waited == b""
    assert _complete(served, WAITER_TOKENS)
    assert middleware.egress_budget.peak_bytes == 0
    assert counters["connect_failures"] >= 1 and counters["sent"] == 0
