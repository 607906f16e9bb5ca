"""llama-cpp-python's real server on the CPU, wrapped by the kvwatch ASGI middleware, with a
tiny random-weight model: a stalled client holds its one generation lock until `kvwatch run`
(enforce) detaches it through the hook, park_seconds into its back-pressure, or, with park off,
cancels it after the proof; the waiting request is then served."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.lab.asgi_servers import read_all
from kvwatch.lab.harness.cut_stack import CutStack
from kvwatch.lab.harness.stack import Service, free_port, wait_until_up
from kvwatch.lab.tiny_gguf import (
    TinyLlama,
    ascii_forever_bias,
    write_tiny_llama,
)
from kvwatch.lab.waiting import wait_for
from tests.e2e.llama_required import require_llama_cpp
from tests.metrics_text import metric_value

require_llama_cpp()
pytestmark = [pytest.mark.bpf, pytest.mark.slow]

MODEL = TinyLlama()
ACTION_SECONDS = 30.0
# The waiting request of the detach test is served once the detached generation ends (~10 s
# idle, 30 s to over 60 s on a machine the parallel suite loads). The proof of its stalled
# reader at the default 4 KB/s came at 30 s there; at this rate it needs about four minutes.
SERVED_SECONDS = 150.0
DETACH_TEST_READER_RATE = 512
WRAPPED = "kvwatch.hook.asgi:wrapped_factory"
UNWRAPPED = "llama_cpp.server.app:create_app"


@dataclass
class LlamaServer:
    port: int
    service: Service

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "tiny.gguf", MODEL)


@pytest.fixture
def servers() -> Iterator[list[LlamaServer]]:
    started: list[LlamaServer] = []
    yield started
    for server in started:
        server.service.stop()


def start_llama(
    servers: list[LlamaServer], model_path: Path, factory: str, hook_socket: Path
) -> LlamaServer:
    """`uvicorn --factory FACTORY` serving llama-cpp-python's app (MODEL etc. from the env)."""
    port = free_port()
    log = model_path.parent / f"llama-{port}.log"
    env = {
        **os.environ,
        "MODEL": str(model_path),
        "N_CTX": str(MODEL.context_length),
        "N_THREADS": "1",
        # By default a new request interrupts the running stream (cutting a healthy client
        # short); off, the one generation lock is held by whoever streams — stalled or not.
        "INTERRUPT_REQUESTS": "false",
        "KVWATCH_WRAP_FACTORY": UNWRAPPED,
        "KVWATCH_ENGINE_SOCKET": str(hook_socket),
    }
    command = [sys.executable, "-m", "uvicorn", "--factory", factory, "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = LlamaServer(port, Service("llama-cpp-python", process, log))
    servers.append(server)
    wait_until_up(f"{server.url}/v1/models", process, f"llama-cpp-python ({log})")
    return server


def completion(max_tokens: int, request_id: str, *, greedy: bool = False) -> bytes:
    """A streaming completion; llama-cpp-python's server refuses (400) an X-Request-Id that
    is not a UUID, so `request_id` is one."""
    body = {
        "prompt": "abc",
        "max_tokens": max_tokens,
        "stream": True,
        "logit_bias": ascii_forever_bias(),
        **({"temperature": 0.0} if greedy else {}),
    }
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def stalled_client(
    port: int, request_id: str, rcvbuf_bytes: int = 4096, max_tokens: int | None = None
) -> socket.socket:
    """Asks for a long stream (the whole context unless told), reads its first bytes, then
    never reads again; `rcvbuf_bytes` 0 keeps the kernel's default receive buffer."""
    client = socket.socket()
    if rcvbuf_bytes:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    client.connect(("127.0.0.1", port))
    client.sendall(completion(max_tokens or MODEL.context_length - 64, request_id))
    assert client.recv(256), "the stream started"
    return client


@dataclass
class Reader:
    """A healthy client in a thread: reads its whole stream; `texts` are the tokens' text."""

    port: int
    request: bytes
    texts: list[str] = field(default_factory=list)
    complete: bool = False
    done_at: float | None = None
    error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=60) as client:
                client.sendall(self.request)
                data = read_all(client, timeout=60)
            self.texts = sse_texts(data)
            self.complete = b"data: [DONE]" in data
            self.done_at = time.monotonic()
        except BaseException as exc:
            self.error = exc


def joined_row(
    stack: CutStack, request_id: str, states: tuple[str, ...] = (), timeout_seconds: float = 5.0
) -> dict[str, Any]:
    """The agent's `streams --json` row for `request_id`, once it has joined it (and the
    row is in one of `states`, when given)."""

    def row() -> dict[str, Any] | None:
        for found in httpx.get(f"{stack.agent_url}/api/v1/streams").json():
            if found["request_id"] == request_id and (not states or found["state"] in states):
                return dict(found)
        return None

    what = f"the agent to join {request_id} to a socket" + (f" in {states}" if states else "")
    return wait_for(row, timeout_seconds, what, poll_seconds=0.05)


def sse_texts(raw: bytes) -> list[str]:
    texts = []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {"):
            texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    return texts


def test_a_stalled_client_is_cancelled_and_the_waiting_request_served(
    stack: CutStack, servers: list[LlamaServer], model_path: Path
) -> None:
    server = start_llama(servers, model_path, WRAPPED, stack.hook_socket)
    stack.start_agent("--mode", "enforce", "--action", "cancel", port=server.port)
    healthy = Reader(server.port, completion(50, str(uuid.uuid4())))
    healthy.start().join(60)
    stack.wait_engine_connected()
    stalled_id = str(uuid.uuid4())
    stalled = stalled_client(server.port, stalled_id)
    row = joined_row(stack, stalled_id)  # before the agent acts (it needs 2 s of stall)
    # Its window shut: the stalled request is blocked, holding llama-cpp-python's one
    # generation lock, when the next request comes.
    joined_row(stack, stalled_id, ("zero_window", "stalled"), timeout_seconds=ACTION_SECONDS)
    waiting = Reader(server.port, completion(50, str(uuid.uuid4())))
    asked_at = time.monotonic()
    waiting.start().join(ACTION_SECONDS + 30)
    with pytest.raises((ConnectionResetError, TimeoutError)):
        stalled.settimeout(5)
        while stalled.recv(65536):
            pass
    stalled.close()

    assert healthy.error is None and healthy.complete
    assert waiting.error is None and waiting.complete, waiting.error
    assert waiting.done_at is not None
    print(f"the waiting request was served {waiting.done_at - asked_at:.1f} s after it came")
    decisions = stack.audit_entries("decision")
    acted = [d for d in decisions if d["verdict"] == "act"]
    assert {d["request_id"] for d in acted} == {stalled_id}, decisions
    outcomes = [o for o in stack.audit_entries("outcome") if o["result"]["status"] == "cancelled"]
    assert [o["request_id"] for o in outcomes] == [stalled_id]
    context_kv_bytes = MODEL.context_length * MODEL.kv_bytes_per_token
    assert (row["engine"], row["kv_bytes"], row["kv_estimated"]) == (
        "llama-cpp-python",
        context_kv_bytes,
        True,
    )
    assert outcomes[0]["result"]["freed_bytes"] == context_kv_bytes
    metrics = httpx.get(f"{stack.agent_url}/metrics").text
    assert metric_value(metrics, "kvwatch_actions_reclaimed_kv_bytes_total") == context_kv_bytes


def test_a_stalled_client_is_detached_and_the_waiting_request_served_before_any_proof(
    stack: CutStack, servers: list[LlamaServer], model_path: Path
) -> None:
    """A client with the kernel's default receive buffer stops reading a 4000-token answer
    (~1 MB of SSE: more than its buffers hold): the agent detaches its stream park_seconds
    into its back-pressure or its reader's backlog, the generation runs to its end into the
    middleware's buffer and releases the lock, and the waiting request is served — long
    before the reader-rate proof (about four minutes for such a buffer at 512 B/s) could cut
    anyone."""
    server = start_llama(servers, model_path, WRAPPED, stack.hook_socket)
    stack.start_agent(
        "--mode",
        "enforce",
        "--park",
        "on",
        "--min-reader-rate",
        str(DETACH_TEST_READER_RATE),
        port=server.port,
    )
    stack.wait_engine_connected()
    stalled_id = str(uuid.uuid4())
    stalled = stalled_client(server.port, stalled_id, rcvbuf_bytes=0, max_tokens=4000)
    joined_row(stack, stalled_id, ("zero_window", "stalled"), timeout_seconds=ACTION_SECONDS)
    waiting = Reader(server.port, completion(50, str(uuid.uuid4())))
    asked_at = time.monotonic()
    # The rest of the 4000 tokens first (~10 s idle; several times that on a loaded machine).
    waiting.start().join(SERVED_SECONDS)
    try:
        assert waiting.error is None and waiting.complete, waiting.error
        assert waiting.done_at is not None
        served_seconds = waiting.done_at - asked_at
        print(f"the waiting request was served {served_seconds:.1f} s after it came")
        outcomes = [o for o in stack.audit_entries("outcome") if o["request_id"] == stalled_id]
        assert [(o["action"], o["result"]["status"]) for o in outcomes][:1] == [
            ("detach", "detached")
        ], outcomes
        decision = next(
            d
            for d in stack.audit_entries("decision")
            if d["decision_id"] == outcomes[0]["decision_id"]
        )
        # Parked from the writer's back-pressure or from the reader's backlog, whichever the
        # agent saw first: both are the park rule, long before the proof.
        assert decision["verdict"] == "act", decision
        assert decision["reason"] in ("backpressure", "reader_still_behind"), decision
        assert not [o for o in outcomes if o["action"] in ("cancel", "reset")], "no cut yet"
    finally:
        stalled.close()


def test_without_an_agent_the_server_answers_as_it_does_unwrapped(
    tmp_path: Path, servers: list[LlamaServer], model_path: Path
) -> None:
    absent = tmp_path / "no-agent.sock"
    texts = []
    for factory in (WRAPPED, UNWRAPPED):
        server = start_llama(servers, model_path, factory, absent)
        reader = Reader(server.port, completion(40, str(uuid.uuid4()), greedy=True))
        reader.start().join(60)
        assert reader.error is None
        texts.append(reader.texts)
    assert len(texts[0]) >= 40
    assert texts[0] == texts[1]
