"""End to end with vLLM's real OpenAI server (`vllm serve`: API server and EngineCore
processes) running kvwatch's scheduler and middleware; the only stand-in is the model
(tests.support.executor). A live streaming request is paused, parked and resumed by its
X-Request-Id through the middleware's handlers — the same `Dispatch` the engine hook runs for
the agent — reached here over the middleware's control socket, without an agent (the agent
drives them in test_server_agent_e2e.py). The server is the session's (conftest.py).
"""

from __future__ import annotations

import time

import pytest

from tests.support.server import VllmServer, control, stream_completion
from tests.support.tokens import expected_output

pytestmark = pytest.mark.server

PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks of 16 with the first output token
MAX_TOKENS = 1000  # ~7 s of generation at the server's pace: time to act on a live request
QUIET_SECONDS = 0.6  # how long a held stream is watched for tokens (100 engine steps)


def engine_tokens_stay(server: VllmServer, request_id: str, engine_id: str) -> bool:
    """Whether the engine produces no token for the request within QUIET_SECONDS (the
    measurement window of a hold; tokens produced before the hold may still be on their way
    to the client, so the engine's count is what is watched)."""
    before = control(server.control_path, "kv_state", request_id)["output_tokens"][engine_id]
    time.sleep(QUIET_SECONDS)
    after = control(server.control_path, "kv_state", request_id)["output_tokens"][engine_id]
    return bool(after == before)


def test_a_live_request_is_paused_parked_and_resumed_by_its_x_request_id(
    server: VllmServer,
) -> None:
    started = time.monotonic()
    stream = stream_completion(server.port, "kvw-e2e-1", PROMPT, MAX_TOKENS)
    assert stream.first_chunk.wait(60), server.log_tail()
    assert stream.error is None, stream.error
    state = control(server.control_path, "kv_state", "kvw-e2e-1")
    (engine_id,) = state["engine_ids"]
    assert engine_id.startswith("cmpl-kvw-e2e-1-0-")  # vLLM's internal id, mapped exactly
    assert state["blocks"][engine_id] >= 3

    paused = control(server.control_path, "pause", "kvw-e2e-1")
    assert paused["status"] == "paused", paused
    assert engine_tokens_stay(server, "kvw-e2e-1", engine_id), "tokens while paused"
    state = control(server.control_path, "kv_state", "kvw-e2e-1")
    assert state["held"] == {engine_id: "paused"}
    held_blocks = state["blocks"][engine_id]
    assert held_blocks >= 3  # a pause keeps the KV

    parked = control(server.control_path, "park", "kvw-e2e-1")
    assert parked["status"] == "parked", parked
    assert parked["freed_blocks"] == held_blocks
    after = control(server.control_path, "kv_state", "kvw-e2e-1")
    assert after["free_blocks"] - state["free_blocks"] == held_blocks  # vLLM's pool got them
    assert after["blocks"][engine_id] == 0
    assert after["held"] == {engine_id: "parked"}
    print(  # the numbers docs/engines.md quotes (pytest -s)
        f"\npark: {parked['freed_blocks']} blocks, {parked['freed_bytes']} bytes freed; "
        f"free pool {state['free_blocks']} -> {after['free_blocks']} of {after['total_blocks']}"
    )
    assert engine_tokens_stay(server, "kvw-e2e-1", engine_id), "tokens while parked"
    produced = after["output_tokens"][engine_id]
    assert len(stream.token_ids) <= produced < MAX_TOKENS  # the client has no more than that

    released = control(server.control_path, "resume", "kvw-e2e-1")
    assert released["status"] == "released", released  # the protocol's word for a resume
    assert stream.done.wait(60), server.log_tail()
    assert stream.error is None, stream.error
    assert stream.token_ids == expected_output(PROMPT, MAX_TOKENS)
    assert stream.finish_reason == "length"
    assert stream.body.endswith(b"data: [DONE]\n\n")

    # An unheld run of the same request: the same tokens (chunking follows timing).
    plain = stream_completion(server.port, "kvw-e2e-plain", PROMPT, MAX_TOKENS)
    assert plain.done.wait(60) and plain.error is None
    assert plain.token_ids == stream.token_ids

    print(f"held stream done in {time.monotonic() - started:.1f} s")

    # The stream is over: its id is no longer a live stream.
    assert control(server.control_path, "pause", "kvw-e2e-1")["status"] == "unknown_request"
    assert control(server.control_path, "park", "never-seen")["status"] == "unknown_request"
