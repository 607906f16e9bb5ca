"""The OpenAI-compatible API over real HTTP: streams parsed by a real SSE client (httpx-sse),
non-streaming bodies, request ids, OpenAI-style errors, overload, metrics and health."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from kvwatch.lab.engine.engine_server import EngineServer
from kvwatch.lab.engine.requests import GenerationRequest
from kvwatch.lab.waiting import wait_for, wait_until
from tests.engine.conftest import StalledClient

pytestmark = pytest.mark.engine

MODEL = "kvwatch-reference-tiny"


@pytest.fixture
def server(make_server: Callable[..., EngineServer]) -> EngineServer:
    return make_server(max_tokens_limit=512)


@pytest.fixture
def client(server: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    with connect_sse(http, "POST", path, json=body) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [event.data for event in source.iter_sse()]


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [MODEL]


def test_completion_stream_chunks_end_with_done_and_match_the_plain_response(
    client: httpx.Client,
) -> None:
    request = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12}
    data = stream_events(client, "/v1/completions", {**request, "stream": True})
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(chunk["model"] == MODEL for chunk in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 12 + ["length"]
    streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks)

    plain = client.post("/v1/completions", json=request).json()
    assert plain["object"] == "text_completion"
    assert plain["choices"][0]["text"] == streamed  # greedy: same text either way
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"] == {"prompt_tokens": 17, "completion_tokens": 12, "total_tokens": 29}


def test_chat_stream_has_role_first_content_deltas_and_usage(client: httpx.Client) -> None:
    body = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data = stream_events(client, "/v1/chat/completions", body)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:6]]
    assert len("".join(contents)) == 5
    assert chunks[6]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert chunks[7]["choices"] == []
    assert chunks[7]["usage"]["completion_tokens"] == 5


def test_chat_plain_response(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    response = client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 7})
    assert response.status_code == 200
    payload = response.json()
    assert payload["object"] == "chat.completion"
    assert payload["choices"][0]["message"]["role"] == "assistant"
    assert len(payload["choices"][0]["message"]["content"]) == 7


def test_x_request_id_is_honoured(client: httpx.Client) -> None:
    plain = client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "t-1"}
    )
    assert plain.json()["id"] == "cmpl-t-1"
    assert plain.headers["x-request-id"] == "cmpl-t-1"
    with connect_sse(
        client,
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "t-2"},
    ) as source:
        assert source.response.headers["x-request-id"] == "chatcmpl-t-2"
        ids = {json.loads(e.data)["id"] for e in source.iter_sse() if e.data != "[DONE]"}
    assert ids == {"chatcmpl-t-2"}


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 513}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "stream_options": {}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 2100, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 1900, "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    client: httpx.Client, path: str, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_oversized_body_is_refused(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": "x" * (1 << 20)})
    assert response.status_code == 413
    assert response.json()["error"]["message"]


def test_seeded_sampling_repeats_and_seeds_differ(client: httpx.Client) -> None:
    def sample(seed: int) -> str:
        body = {"prompt": "roll", "max_tokens": 24, "temperature": 1.5, "seed": seed}
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert isinstance(text, str)
        return text

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_wrong_method_and_unknown_path_get_json_errors(client: httpx.Client) -> None:
    assert client.get("/v1/completions").json()["error"]["message"]
    assert client.get("/v1/completions").status_code == 405
    assert client.get("/v2/nothing").status_code == 404


def test_too_long_for_the_pool_is_rejected_up_front(
    make_server: Callable[..., EngineServer],
) -> None:
    small = make_server(kv_blocks=4)  # 64 tokens in all
    response = httpx.post(f"{small.url}/v1/completions", json={"prompt": "a", "max_tokens": 100})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_overload_and_duplicate_ids_are_refused_while_a_stream_is_stuck(
    make_server: Callable[..., EngineServer], stalled_clients: list[StalledClient]
) -> None:
    server = make_server(max_running=1, max_waiting=1)
    body = json.dumps({"prompt": "s", "max_tokens": 900, "stream": True}).encode()
    stalled_clients.append(StalledClient(server.address, body, request_id="stuck"))
    server.engine.submit(GenerationRequest("waiting-one", [256, 65], max_tokens=4))
    wait_until(lambda: server.engine.stats().waiting == 1, 20, "one request waiting")

    busy = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "overloaded"
    duplicate = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "a", "max_tokens": 2},
        headers={"X-Request-Id": "stuck"},
    )
    assert duplicate.status_code == 400
    assert duplicate.json()["error"]["code"] == "duplicate_request_id"
    assert server.engine.cancel("cmpl-stuck", "test cleanup").status == "cancelled"
    wait_until(lambda: server.engine.stats().waiting == 0, 20, "no request waiting")


def test_requests_shows_live_and_finished_requests_with_their_token_counts(
    server: EngineServer, client: httpx.Client, stalled_clients: list[StalledClient]
) -> None:
    client.post(
        "/v1/completions", json={"prompt": "d", "max_tokens": 5}, headers={"X-Request-Id": "d"}
    )
    body = json.dumps({"prompt": "s", "max_tokens": 400, "stream": True}).encode()
    stalled_clients.append(StalledClient(server.address, body, request_id="stuck"))

    def report(request_id: str, state: str) -> dict[str, Any] | None:
        response = client.get(f"/v1/requests/{request_id}")
        found: dict[str, Any] = response.json()
        return found if found.get("state") == state else None

    def held(found: dict[str, Any] | None) -> dict[str, Any] | None:
        """Its writer holds what it took in a send its client does not take, and the
        engine's queue is full: 4 tokens generated, not taken."""
        untaken = found is not None and found["tokens_generated"] - found["tokens_taken"]
        return found if untaken == 4 else None

    stuck = wait_for(lambda: held(report("cmpl-stuck", "egress_blocked")), 20, "it stuck")
    assert stuck["kv_blocks"] > 0 and stuck["finish_reason"] is None
    assert server.engine.pause("cmpl-stuck", "test").status == "paused"
    wait_for(lambda: report("cmpl-stuck", "paused"), 20, "the paused state")
    assert server.engine.park("cmpl-stuck", "test").status == "parked"
    parked = wait_for(lambda: report("cmpl-stuck", "parked"), 20, "the parked state")
    assert parked["kv_blocks"] == 0
    assert server.engine.cancel("cmpl-stuck", "test").status == "cancelled"

    listed = {r["request_id"]: r for r in client.get("/v1/requests").json()["data"]}
    assert listed["cmpl-d"] == {
        "request_id": "cmpl-d",
        "state": "finished",
        "kv_blocks": 0,
        "tokens_generated": 5,
        "tokens_taken": 5,
        "finish_reason": "length",
    }
    assert (listed["cmpl-stuck"]["state"], listed["cmpl-stuck"]["finish_reason"]) == (
        "cancelled",
        "abort",
    )
    missing = client.get("/v1/requests/cmpl-nobody")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "request_not_found"


def test_metrics_and_health(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "m", "max_tokens": 3})
    assert client.get("/health").status_code == 200
    text = client.get("/metrics").text
    for name in (
        "kvwatch_engine:num_requests_running",
        "kvwatch_engine:num_requests_waiting",
        "kvwatch_engine:kv_cache_usage_perc",
        "kvwatch_engine:kv_cache_blocks_used",
        "kvwatch_engine:num_preemptions_total",
        "kvwatch_engine:num_requests_paused",
        "kvwatch_engine:num_pauses_total",
        "kvwatch_engine:num_releases_total",
        "kvwatch_engine:time_to_first_token_seconds_bucket",
        "kvwatch_engine:inter_token_latency_seconds_bucket",
        'kvwatch_engine:request_success_total{finished_reason="length"}',
    ):
        assert name in text, name
