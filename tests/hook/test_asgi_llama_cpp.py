"""llama-cpp-python's real server, wrapped by the middleware, against a real (test) agent: a
request waiting for the one generation lock gets sse-starlette's pings, and is neither
announced nor counted KV until its first token — then under the engine's own `cmpl-…` id,
holding the context's KV while the request before it no longer does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvwatch.hookwire.protocol import Cancel, Cancelled, Close, EngineInfo, Open, Update
from kvwatch.lab.asgi_servers import open_client, read_all, read_until
from kvwatch.lab.harness.stack import Service, free_port, wait_until_up
from kvwatch.lab.llama_servers import llama_completion
from kvwatch.lab.tiny_gguf import TinyLlama, write_tiny_llama
from tests.e2e.llama_required import require_llama_cpp
from tests.hook.hook_agent import AgentServer, of_kind
from tests.hook.llama_pinging import PING_SECONDS_ENV

require_llama_cpp()
pytestmark = pytest.mark.slow

MODEL = TinyLlama()
REPO = Path(__file__).resolve().parents[2]
PING_SECONDS = 0.1
WAITER_TOKENS = 20


@pytest.fixture
def llama_server(tmp_path: Path, socket_path: str) -> Iterator[int]:
    """`uvicorn --factory kvwatch.hook.asgi:wrapped_factory` around llama-cpp-python's app
    (pinging every PING_SECONDS), its hook on the test's socket; yields its port."""
    port = free_port()
    env = {
        **os.environ,
        "MODEL": str(write_tiny_llama(tmp_path / "tiny.gguf", MODEL)),
        "N_CTX": str(MODEL.context_length),
        "N_THREADS": "1",
        "INTERRUPT_REQUESTS": "false",  # the running stream keeps the lock; the next one waits
        "KVWATCH_WRAP_FACTORY": "tests.hook.llama_pinging:create_app",
        "KVWATCH_ENGINE_SOCKET": socket_path,
        PING_SECONDS_ENV: str(PING_SECONDS),
    }
    command = [sys.executable, "-m", "uvicorn", "--factory", "kvwatch.hook.asgi:wrapped_factory"]
    log = tmp_path / "llama.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--port", str(port)], cwd=REPO, env=env, stdout=out, stderr=out
        )
    service = Service("llama-cpp-python", process, log)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/v1/models", process, f"llama-cpp-python ({log})")
        yield port
    finally:
        service.stop()


def test_a_request_waiting_for_the_lock_is_announced_at_its_first_token_by_its_cmpl_id(
    llama_server: int, agent_factory: Callable[..., AgentServer]
) -> None:
    agent = agent_factory()
    holder = open_client(llama_server, llama_completion(llama_server, 30_000), rcvbuf=4096)
    held = agent.wait_for(lambda ms: bool(of_kind(ms, Open)), 30)  # it has the lock
    holder_id = of_kind(held, Open)[0].request_id
    waiter = open_client(llama_server, llama_completion(llama_server, WAITER_TOKENS))
    waited = read_until(waiter, lambda data: data.count(b": ping") >= 3)
    opened_while_waiting = [m.request_id for m in of_kind(agent.messages, Open)]
    agent.send(Cancel(request_id=holder_id, reason="stalled", correlation_id="c-1"))
    answer = agent.first(Cancelled, holder_id)
    streamed = read_all(waiter, timeout=60)
    waiter.close()
    holder.close()
    waiter_id = json.loads(streamed.split(b"data: ", 1)[1].split(b"\n", 1)[0])["id"]
    opened = agent.first(Open, waiter_id)
    closed = agent.first(Close, waiter_id)

    context_kv_bytes = MODEL.context_length * MODEL.kv_bytes_per_token
    hello = of_kind(agent.messages, EngineInfo)[0]
    assert (hello.engine, hello.bytes_per_block) == ("llama-cpp-python", context_kv_bytes)
    assert b"data:" not in waited
    assert opened_while_waiting == [holder_id]  # the waiter: no announce, no KV counted
    assert holder_id.startswith("cmpl-") and waiter_id.startswith("cmpl-")
    assert [m.request_id for m in of_kind(agent.messages, Open)] == [holder_id, waiter_id]
    assert (answer.status, answer.freed_bytes) == ("cancelled", context_kv_bytes)
    assert agent.first(Close, holder_id).reason == "cancelled"
    assert opened.kv_blocks == 1  # the whole context, from the first token on
    updates = of_kind(agent.messages, Update, waiter_id)
    assert all(u.kv_blocks == 1 for u in updates)
    # One per chunk: the 20 tokens' and the last one's (finish_reason "length", no text).
    assert max(u.tokens_out for u in updates) == streamed.count(b"data: {") == WAITER_TOKENS + 1
    assert closed.reason == "finished"
