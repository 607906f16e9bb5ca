"""EngineHook against a real agent on a real unix socket: announce, reconnect, cancel, survive."""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Callable

import pytest

from kvwatch.errors import ConfigError, ProtocolError
from kvwatch.hook import DEFAULT_SOCKET_PATH, SOCKET_PATH_ENV, CommandOutcome, EngineHook
from kvwatch.hookwire.protocol import (
    Cancel,
    Cancelled,
    Close,
    EngineInfo,
    ErrorMessage,
    Message,
    Open,
    Update,
)
from kvwatch.sockets import Endpoint
from tests.hook.conftest import default_handler
from tests.hook.hook_agent import ENGINE_INFO, AgentServer, wait_until

AgentFactory = Callable[..., AgentServer]
HookFactory = Callable[..., EngineHook]
SERVER = ("127.0.0.1", 8000)


def _client(port: int) -> tuple[str, int]:
    return ("127.0.0.1", port)


def _of_type(messages: list[Message], kind: type[Message]) -> list[Message]:
    return [m for m in messages if isinstance(m, kind)]


def _cancel(request_id: str, correlation_id: str) -> Cancel:
    return Cancel(
        request_id=request_id,
        reason="stalled",
        correlation_id=correlation_id,
        evidence={"no_progress_seconds": 3.1, "peer_rwnd": 0},
    )


def _answer(agent: AgentServer, correlation_id: str, timeout: float = 5.0) -> Cancelled:
    messages = agent.wait_for(
        lambda ms: any(getattr(m, "correlation_id", None) == correlation_id for m in ms),
        timeout,
    )
    answer = next(m for m in messages if getattr(m, "correlation_id", None) == correlation_id)
    assert isinstance(answer, Cancelled)
    return answer


def _hook_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvwatch-hook"]


def test_hello_then_open_update_close_arrive_with_their_fields(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    agent = agent_factory()
    hook = hook_factory()
    wait_until(lambda: hook.connected)
    hook.stream_opened("cmpl-1", SERVER, _client(50000), 2)
    hook.stream_opened("cmpl-2", ("::ffff:10.0.0.5", 8000, 0, 0), ("fe80::1%lo", 40000), 1)  # type: ignore[arg-type]
    for tokens in range(1, 6):
        hook.stream_updated("cmpl-1", 2 + tokens // 4, tokens)
    agent.wait_for(lambda ms: any(getattr(m, "tokens_out", 0) == 5 for m in _of_type(ms, Update)))
    hook.stream_closed("cmpl-1", "finished")
    messages = agent.wait_for(lambda ms: bool(_of_type(ms, Close)))

    assert messages[0] == EngineInfo(
        engine="kvwatch-reference",
        model="tiny",
        pid=ENGINE_INFO.pid,
        bytes_per_block=16384,
        device="cpu",
        kv_blocks_total=128,
    )
    opens = _of_type(messages, Open)
    assert opens[0] == Open(
        request_id="cmpl-1",
        local=Endpoint("127.0.0.1", 8000),
        remote=Endpoint("127.0.0.1", 50000),
        pid=ENGINE_INFO.pid,
        kv_blocks=2,
        bytes_per_block=16384,
        device="cpu",
    )
    assert (str(opens[1].local), str(opens[1].remote)) == ("10.0.0.5:8000", "[fe80::1]:40000")  # type: ignore[attr-defined]
    updates = _of_type(messages, Update)
    assert 1 <= len(updates) <= 5  # queued updates of one stream coalesce
    assert updates[-1] == Update(request_id="cmpl-1", kv_blocks=3, tokens_out=5)
    assert messages[-1] == Close(request_id="cmpl-1", reason="finished")
    counters = hook.counters()
    assert counters["live_streams"] == 1
    assert counters["dropped_queue_full"] == counters["malformed_received"] == 0
    assert agent.errors == []


def test_agent_restart_gets_hello_and_live_streams_again(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    agent = agent_factory()
    hook = hook_factory()
    hook.stream_opened("live", SERVER, _client(50001), 4)
    hook.stream_opened("gone", SERVER, _client(50002), 1)
    agent.wait_for(lambda ms: len(_of_type(ms, Open)) == 2)
    agent.stop()
    wait_until(lambda: not hook.connected)
    hook.stream_closed("gone", "finished")
    hook.stream_updated("live", 6, 30)  # while the agent is away

    restarted = agent_factory()
    messages = restarted.wait_for(lambda ms: bool(_of_type(ms, Open)))
    assert isinstance(messages[0], EngineInfo)
    assert [(m.request_id, m.kv_blocks, m.tokens_out) for m in _of_type(messages, Open)] == [  # type: ignore[attr-defined]
        ("live", 6, 30)
    ]
    wait_until(lambda: hook.connected)
    assert hook.counters()["reconnects"] == 1
    assert hook.counters()["disconnects"] == 1


def test_absent_agent_never_slows_or_breaks_the_engine(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    hook = hook_factory()
    started = time.perf_counter()
    for number in range(2000):
        hook.stream_opened(f"r{number}", SERVER, _client(1024 + number), 1)
        hook.stream_updated(f"r{number}", 2, 1)
        if number % 2:
            hook.stream_closed(f"r{number}", "finished")
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"5000 stream calls took {elapsed:.2f} s without an agent"
    assert not hook.connected
    wait_until(lambda: hook.counters()["connect_failures"] >= 2)

    agent = agent_factory()  # the agent shows up late: everything live is announced
    messages = agent.wait_for(lambda ms: len(_of_type(ms, Open)) == 1000)
    assert all(m.kv_blocks == 2 for m in _of_type(messages, Open))  # type: ignore[attr-defined]
    assert hook.counters()["dropped_queue_full"] == 0


def test_agent_that_never_reads_costs_the_engine_nothing(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    agent = agent_factory(reading=False)
    hook = hook_factory(queue_size=64, send_timeout_seconds=30.0)
    wait_until(lambda: hook.connected)
    durations = []
    for number in range(4000):
        started = time.perf_counter()
        hook.stream_opened(f"r{number}", SERVER, _client(1024 + number), 1)
        if number % 2:
            hook.stream_closed(f"r{number}", "finished")
        durations.append(time.perf_counter() - started)
    # A call that waited on the agent's socket would take the 30 s send timeout. Far below
    # that, the slowest call is the scheduler's doing (hundreds of ms on a busy 2-core VM).
    assert max(durations) < 2.0, f"one stream call took {max(durations) * 1000:.1f} ms"
    assert statistics.median(durations) < 0.001, f"median {statistics.median(durations)} s"
    wait_until(lambda: hook.counters()["dropped_queue_full"] > 0)

    agent.resume_reading()  # the agent recovers: a resync restores the exact live set
    messages = agent.wait_for(lambda ms: len(_of_type(ms, EngineInfo)) >= 2)
    last_hello = max(i for i, m in enumerate(messages) if isinstance(m, EngineInfo))
    messages = agent.wait_for(lambda ms: len(_of_type(ms[last_hello:], Open)) >= 2000, timeout=10.0)
    resynced = {m.request_id for m in _of_type(messages[last_hello:], Open)}  # type: ignore[attr-defined]
    assert resynced == {f"r{n}" for n in range(0, 4000, 2)}
    assert hook.counters()["resyncs"] >= 1


def test_agent_that_stops_reading_is_dropped_after_the_send_timeout(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    agent_factory(reading=False)
    hook = hook_factory(queue_size=64, send_timeout_seconds=0.3)
    wait_until(lambda: hook.connected)
    for number in range(4000):
        hook.stream_opened(f"r{number}", SERVER, _client(1024 + number), 1)
    wait_until(lambda: hook.counters()["send_timeouts"] >= 1)
    wait_until(lambda: hook.counters()["reconnects"] >= 1)


def test_cancel_runs_the_handler_off_the_loop_and_answers_with_its_result(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    calls: list[tuple[str, str, str]] = []

    def handler(request_id: str, reason: str) -> CommandOutcome:
        calls.append((request_id, reason, threading.current_thread().name))
        return CommandOutcome(request_id, "cancelled", freed_blocks=4, freed_bytes=65536)

    agent = agent_factory()
    hook = hook_factory(handler)
    hook.stream_opened("cmpl-9", SERVER, _client(50009), 4)
    agent.wait_for(lambda ms: bool(_of_type(ms, Open)))
    agent.send(_cancel("cmpl-9", "c-1"))

    answer = _answer(agent, "c-1")
    assert answer == Cancelled(
        request_id="cmpl-9",
        status="cancelled",
        freed_blocks=4,
        freed_bytes=65536,
        correlation_id="c-1",
    )
    assert calls == [("cmpl-9", "stalled", "kvwatch-hook-cancel")]
    assert hook.counters()["cancels_received"] == hook.counters()["cancels_answered"] == 1


def test_hanging_or_failing_handlers_get_a_failed_answer(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    release = threading.Event()

    def handler(request_id: str, reason: str) -> CommandOutcome:
        if request_id == "hangs":
            release.wait(10)
        if request_id == "raises":
            raise RuntimeError("block table corrupt")
        return CommandOutcome(request_id, "unknown_request", 0, 0, detail="never seen")

    agent = agent_factory()
    hook = hook_factory(handler, cancel_timeout_seconds=0.3)
    wait_until(lambda: hook.connected)
    try:
        started = time.monotonic()
        agent.send(_cancel("hangs", "c-hang"))
        agent.send(_cancel("raises", "c-raise"))
        agent.send(_cancel("nobody", "c-unknown"))
        raised = _answer(agent, "c-raise")
        unknown = _answer(agent, "c-unknown")
        hung = _answer(agent, "c-hang")
        waited = time.monotonic() - started
    finally:
        release.set()
    assert (hung.status, hung.freed_blocks) == ("failed", 0)
    assert "did not finish within 0.3 s" in hung.detail
    assert 0.25 <= waited < 2.0
    assert raised.status == "failed"
    assert "RuntimeError: block table corrupt" in raised.detail
    assert (unknown.status, unknown.detail) == ("unknown_request", "never seen")
    counters = hook.counters()
    assert (counters["cancel_timeouts"], counters["cancel_handler_errors"]) == (1, 1)


def test_garbage_from_the_agent_is_counted_and_ignored(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    agent = agent_factory()
    hook = hook_factory()
    wait_until(lambda: hook.connected)
    agent.send(b"this is not json\n")
    agent.send(b'{"v": 1, "type": "cancel"}\n')
    agent.send(b'{"v": 9, "type": "cancel", "request_id": "x"}\n')
    agent.send(b"x" * 100_000 + b"\n")
    agent.send(
        b'{"v": 1, "type": "close", "request_id": "x", "reason": "agents never send this"}\n'
    )
    agent.send(ErrorMessage(message="slow down", hint="nothing"))
    agent.send(_cancel("still-works", "c-after"))

    assert _answer(agent, "c-after").status == "unknown_request"
    counters = hook.counters()
    assert counters["malformed_received"] == 5
    assert counters["agent_errors_received"] == 1
    assert counters["disconnects"] == 0
    assert hook.connected


def test_bad_engine_input_is_counted_not_raised(hook_factory: HookFactory) -> None:
    hook = hook_factory()
    hook.stream_opened("r1", ("not-an-ip", 80), _client(1), 1)
    hook.stream_opened("r2", SERVER, ("127.0.0.1", 70000), 1)
    hook.stream_opened("r3", SERVER, _client(1), -1)
    hook.stream_opened("", SERVER, _client(1), 1)
    hook.stream_updated("r4", 1, 1)
    hook.stream_closed("r4", "finished")
    counters = hook.counters()
    assert counters["dropped_invalid"] == 4
    assert counters["unknown_stream_events"] == 2
    assert counters["live_streams"] == 0


def test_stop_is_prompt_and_leaves_no_thread(
    agent_factory: AgentFactory, hook_factory: HookFactory
) -> None:
    agent = agent_factory()
    hook = hook_factory()
    wait_until(lambda: hook.connected)
    started = time.monotonic()
    hook.stop()
    assert time.monotonic() - started < 1.0
    assert not _hook_threads()
    assert not hook.connected
    wait_until(lambda: agent.closed_by_peer == 1)
    hook.stop()  # idempotent


def test_socket_path_comes_from_the_argument_the_environment_or_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SOCKET_PATH_ENV, raising=False)
    assert EngineHook(ENGINE_INFO, default_handler).socket_path == DEFAULT_SOCKET_PATH
    monkeypatch.setenv(SOCKET_PATH_ENV, "/tmp/elsewhere.sock")
    assert EngineHook(ENGINE_INFO, default_handler).socket_path == "/tmp/elsewhere.sock"
    assert EngineHook(ENGINE_INFO, default_handler, "/x.sock").socket_path == "/x.sock"


def test_invalid_engine_info_fails_where_it_is_built_and_a_bad_queue_is_a_config_error() -> None:
    with pytest.raises(ProtocolError, match="'hello' message field 'pid'"):
        dataclasses.replace(ENGINE_INFO, pid=-1)
    with pytest.raises(ConfigError, match="queue_size must be positive"):
        EngineHook(ENGINE_INFO, default_handler, queue_size=0)
