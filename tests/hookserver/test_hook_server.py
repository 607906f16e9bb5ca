"""HookServer on real unix sockets, with the real EngineHook and hand-written engine connections."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time

import pytest

from kvwatch.errors import ConfigError
from kvwatch.hook import CommandOutcome, EngineHook
from kvwatch.hookserver.hook_server import EngineStream, HookServer
from kvwatch.hookwire.protocol import (
    Cancel,
    Cancelled,
    Close,
    EngineInfo,
    ErrorMessage,
    LineFramer,
    Open,
    Update,
    Welcome,
    encode,
)
from kvwatch.sockets import Endpoint
from tests.hookserver.conftest import (
    BYTES_PER_BLOCK,
    ENGINE_INFO,
    RawEngine,
    engine_hook,
    exchange_as_uid,
    run_async,
    running_server,
    wait_until,
)

SERVER = ("127.0.0.1", 8000)
LOCAL = Endpoint("127.0.0.1", 8000)
NOBODY_UID = 65534
WAIT_FOR_RELEASE_SECONDS = 10.0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def _client(port: int) -> tuple[str, int]:
    return ("127.0.0.1", port)


def _hello(pid: int = ENGINE_INFO.pid) -> EngineInfo:
    return EngineInfo(
        engine="raw",
        model="tiny",
        pid=pid,
        bytes_per_block=BYTES_PER_BLOCK,
        device="cpu",
        kv_blocks_total=64,
    )


def _open(request_id: str, port: int, kv_blocks: int = 2, pid: int = ENGINE_INFO.pid) -> Open:
    return Open(
        request_id=request_id,
        local=LOCAL,
        remote=Endpoint("127.0.0.1", port),
        pid=pid,
        kv_blocks=kv_blocks,
        bytes_per_block=BYTES_PER_BLOCK,
        device="cpu",
    )


async def _raw_session(path: str) -> RawEngine:
    """A raw engine connection that said hello and got its welcome."""
    engine = await RawEngine.connect(path)
    await engine.send(_hello())
    assert isinstance(await engine.receive(), Welcome)
    return engine


def test_socket_is_created_0660_in_a_new_0755_directory_and_removed_on_close(
    socket_dir: str,
) -> None:
    path = f"{socket_dir}/run/kvwatch/engine.sock"

    async def scenario() -> None:
        async with running_server(path):
            assert stat.S_ISSOCK(os.lstat(path).st_mode)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o755
        assert not os.path.exists(path)

    run_async(scenario())


def test_stale_socket_is_replaced_but_live_socket_and_other_files_are_refused(
    socket_path: str,
) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(socket_path)
    stale.close()  # the file stays behind, nobody listens: what a crashed agent leaves

    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            with pytest.raises(ConfigError, match="already listens"):
                await HookServer(socket_path).start()
            assert server.connection_count() == 0  # the probe is not an engine
            engine = await _raw_session(socket_path)  # the first server still serves
            await engine.close()
        with open(socket_path, "w") as regular:
            regular.write("not a socket")
        with pytest.raises(ConfigError, match="not a socket"):
            await HookServer(socket_path).start()
        with pytest.raises(ConfigError, match="longer than"):
            await HookServer("/tmp/" + "x" * 120).start()

    run_async(scenario())


def test_close_leaves_a_successors_socket_file_alone(socket_path: str) -> None:
    async def scenario() -> None:
        first = HookServer(socket_path, allowed_uids=(os.geteuid(),))
        await first.start()
        os.unlink(socket_path)  # e.g. an operator removed it and a new agent took the path
        async with running_server(socket_path):
            await first.close()
            assert os.path.exists(socket_path)

    run_async(scenario())


def test_engine_hook_streams_are_tracked_and_joined_by_four_tuple(socket_path: str) -> None:
    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, changes),
            engine_hook(socket_path) as hook,
        ):
            hook.stream_opened("cmpl-1", SERVER, _client(50001), kv_blocks=3)
            hook.stream_opened("cmpl-2", SERVER, _client(50002), kv_blocks=1)
            await wait_until(lambda: len(server.streams()) == 2)
            stream = server.find(LOCAL, Endpoint("127.0.0.1", 50001))
            assert stream is not None
            assert (stream.request_id, stream.kv_blocks, stream.kv_bytes) == (
                "cmpl-1",
                3,
                3 * BYTES_PER_BLOCK,
            )
            assert (stream.engine, stream.model, stream.device) == (
                "kvwatch-reference",
                "tiny",
                "cpu",
            )
            assert stream.engine_pid == os.getpid()
            assert server.find(LOCAL, Endpoint("127.0.0.1", 59999)) is None
            [engine] = server.engines()
            assert engine["pid"] == os.getpid()
            assert engine["uid"] == os.geteuid()
            assert (engine["kv_blocks_total"], engine["streams"]) == (128, 2)

            hook.stream_updated("cmpl-1", kv_blocks=7, tokens_out=99)
            await wait_until(
                lambda: changes.calls[-1][1] is not None and changes.calls[-1][1].kv_blocks == 7
            )
            updated = server.find(LOCAL, Endpoint("127.0.0.1", 50001))
            assert updated is not None
            assert (updated.tokens_out, updated.opened_ns) == (99, stream.opened_ns)

            hook.stream_closed("cmpl-1", "finished")
            await wait_until(lambda: changes.removed() == ["cmpl-1"])
            assert server.find(LOCAL, Endpoint("127.0.0.1", 50001)) is None
            counters = server.counters()
            assert (counters["hellos"], counters["opens"], counters["updates"]) == (1, 2, 1)
            assert counters["closes"] == 1
            assert counters["unknown_request_events"] == counters["malformed_messages"] == 0

    run_async(scenario())


def test_estimates_and_full_egress_buffers_reach_the_registry(socket_path: str) -> None:
    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, _),
            engine_hook(socket_path) as hook,
        ):
            hook.stream_opened("est-1", SERVER, _client(50011), kv_blocks=2, kv_estimated=True)
            hook.stream_opened("exact-1", SERVER, _client(50012), kv_blocks=2)
            await wait_until(lambda: len(server.streams()) == 2)
            estimated = server.find(LOCAL, Endpoint("127.0.0.1", 50011))
            exact = server.find(LOCAL, Endpoint("127.0.0.1", 50012))
            assert estimated is not None and exact is not None
            assert (estimated.kv_estimated, exact.kv_estimated) == (True, False)
            assert not estimated.egress_buffer_full

            hook.stream_updated("est-1", kv_blocks=3, tokens_out=9, egress_buffer_full=True)

            def full() -> bool:
                stream = server.find(LOCAL, Endpoint("127.0.0.1", 50011))
                return stream is not None and stream.egress_buffer_full

            await wait_until(full)
            updated = server.find(LOCAL, Endpoint("127.0.0.1", 50011))
            assert updated is not None and updated.kv_estimated and updated.kv_blocks == 3

    run_async(scenario())


def test_engine_disconnect_forgets_its_streams(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path) as (server, changes):
            async with engine_hook(socket_path) as hook:
                hook.stream_opened("cmpl-a", SERVER, _client(50010), kv_blocks=2)
                hook.stream_opened("cmpl-b", SERVER, _client(50011), kv_blocks=2)
                await wait_until(lambda: len(server.streams()) == 2)
            await wait_until(lambda: server.counters()["disconnects"] == 1)
            assert sorted(changes.removed()) == ["cmpl-a", "cmpl-b"]
            assert server.streams() == []
            assert server.engines() == []
            assert "live_streams" not in server.counters()  # a gauge, not an event count

    run_async(scenario())


def test_cancel_round_trip_through_the_engine_hook(socket_path: str) -> None:
    hooks: list[EngineHook] = []

    def handler(request_id: str, reason: str) -> CommandOutcome:
        assert reason == "stalled"
        hooks[0].stream_closed(request_id, "cancelled")  # as an engine does after freeing
        return CommandOutcome(request_id, "cancelled", 3, 3 * BYTES_PER_BLOCK)

    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, changes),
            engine_hook(socket_path, handler) as hook,
        ):
            hooks.append(hook)
            hook.stream_opened("cmpl-c", SERVER, _client(50020), kv_blocks=3)
            await wait_until(lambda: len(server.streams()) == 1)
            outcome = await server.command(
                "cancel", "cmpl-c", "stalled", {"no_progress_seconds": 3.2}
            )
            assert outcome == CommandOutcome("cmpl-c", "cancelled", 3, 3 * BYTES_PER_BLOCK, "")
            assert server.streams() == []
            assert changes.removed() == ["cmpl-c"]
            counters = server.counters()
            assert (counters["cancels_sent"], counters["cancels_answered"]) == (1, 1)
            assert counters["unknown_request_events"] == 0  # close came first, then the answer

            unknown = await server.command("cancel", "cmpl-nope", "stalled", {})
            assert (unknown.status, unknown.freed_blocks, unknown.freed_bytes) == (
                "unknown_request",
                0,
                0,
            )
            assert unknown.detail
            assert server.counters()["cancels_sent"] == 1  # nothing was sent
            assert hook.counters()["cancels_received"] == 1

    run_async(scenario())


def test_cancel_times_out_and_the_late_answer_is_counted(socket_path: str) -> None:
    release = threading.Event()

    def slow_handler(request_id: str, reason: str) -> CommandOutcome:
        release.wait(WAIT_FOR_RELEASE_SECONDS)
        return CommandOutcome(request_id, "cancelled", 2, 2 * BYTES_PER_BLOCK)

    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, changes),
            engine_hook(socket_path, slow_handler) as hook,
        ):
            hook.stream_opened("cmpl-s", SERVER, _client(50030), kv_blocks=2)
            await wait_until(lambda: len(server.streams()) == 1)
            started = time.monotonic()
            outcome = await server.command("cancel", "cmpl-s", "stalled", {}, timeout_seconds=0.3)
            assert 0.3 <= time.monotonic() - started < 1.0
            assert (outcome.status, outcome.freed_blocks) == ("failed", 0)
            assert outcome.detail == "no answer within 0.3 s"
            assert server.counters()["cancel_timeouts"] == 1
            release.set()
            await wait_until(lambda: server.counters()["unmatched_cancel_answers"] == 1)
            # The late answer still says the request is gone, so the stream is forgotten.
            assert changes.removed() == ["cmpl-s"]
            assert server.counters()["cancels_answered"] == 0

    try:
        run_async(scenario())
    finally:
        release.set()


def test_cancel_fails_when_the_engine_disconnects_while_waiting(socket_path: str) -> None:
    release = threading.Event()

    def stuck_handler(request_id: str, reason: str) -> CommandOutcome:
        release.wait(WAIT_FOR_RELEASE_SECONDS)
        return CommandOutcome(request_id, "failed", 0, 0, "released")

    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            async with engine_hook(socket_path, stuck_handler) as hook:
                hook.stream_opened("cmpl-d", SERVER, _client(50040), kv_blocks=2)
                await wait_until(lambda: len(server.streams()) == 1)
                waiting = asyncio.create_task(
                    server.command("cancel", "cmpl-d", "stalled", {}, 5.0)
                )
                await wait_until(lambda: hook.counters()["cancels_received"] == 1)
            outcome = await asyncio.wait_for(waiting, 2.0)
            assert outcome.status == "failed"
            assert "closed before it answered" in outcome.detail
            assert server.counters()["cancels_lost"] == 1

    try:
        run_async(scenario())
    finally:
        release.set()


def test_cancel_answer_and_close_in_either_order(socket_path: str) -> None:
    async def answer(engine: RawEngine, *, close_first: bool) -> None:
        cancel = await engine.receive()
        assert isinstance(cancel, Cancel)
        assert cancel.evidence == {"peer_rwnd": 0}
        done = Cancelled(
            request_id=cancel.request_id,
            status="cancelled",
            freed_blocks=2,
            freed_bytes=2 * BYTES_PER_BLOCK,
            correlation_id=cancel.correlation_id,
        )
        close = Close(request_id=cancel.request_id, reason="cancelled")
        await engine.send(*((close, done) if close_first else (done, close)))

    async def scenario() -> None:
        async with running_server(socket_path) as (server, changes):
            engine = await _raw_session(socket_path)
            await engine.send(_open("r-1", 50050), _open("r-2", 50051))
            await wait_until(lambda: len(server.streams()) == 2)
            for request_id, close_first in (("r-1", True), ("r-2", False)):
                reply = asyncio.create_task(answer(engine, close_first=close_first))
                outcome = await server.command("cancel", request_id, "stalled", {"peer_rwnd": 0})
                await reply
                assert (outcome.status, outcome.freed_bytes) == ("cancelled", 2 * BYTES_PER_BLOCK)
            await engine.send(_open("r-3", 50052))
            await wait_until(lambda: len(server.streams()) == 1)
            assert changes.removed() == ["r-1", "r-2"]
            counters = server.counters()
            assert counters["unknown_request_events"] == counters["unmatched_cancel_answers"] == 0
            await engine.send(
                Cancelled(
                    request_id="r-3",
                    status="failed",
                    freed_blocks=0,
                    freed_bytes=0,
                    correlation_id="c-999",
                )
            )
            await wait_until(lambda: server.counters()["unmatched_cancel_answers"] == 1)
            assert [s.request_id for s in server.streams()] == ["r-3"]
            await engine.close()

    run_async(scenario())


def test_malformed_and_oversized_lines_are_counted_and_the_connection_continues(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with running_server(socket_path) as (server, _), engine_hook(socket_path) as hook:
            engine = await _raw_session(socket_path)
            await engine.send(
                b"not json\n",
                b'{"v":1,"type":"open"}\n',  # required fields missing
                b"[1, 2]\n",
                b'{"v":1,"type":"cancel","request_id":"x","reason":"r","correlation_id":"c"}\n',
                b"\n",  # empty lines are ignored, not counted
            )
            for _ in range(4):  # an oversized line, written in pieces
                await engine.send(b"x" * 50_000)
            await engine.send(b"\n", _open("after-garbage", 50060))
            await wait_until(lambda: len(server.streams()) == 1)
            counters = server.counters()
            assert (counters["malformed_messages"], counters["oversized_lines"]) == (5, 1)
            hook.stream_opened("hook-stream", SERVER, _client(50061), kv_blocks=1)
            await wait_until(lambda: len(server.streams()) == 2)  # the others are served too
            await engine.close()

    run_async(scenario())


def test_deep_nesting_and_lone_surrogates_are_malformed_and_the_connection_stays(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            engine = await RawEngine.connect(socket_path)
            surrogate_hello = encode(_hello()).replace(b'"engine":"raw"', b'"engine":"\\ud800"')
            await engine.send(surrogate_hello)  # not a session: no welcome
            await engine.send(_hello())
            assert isinstance(await engine.receive(), Welcome)
            await engine.send(b"[" * 30_000 + b"]" * 30_000 + b"\n")
            await engine.send(_open("after-nesting", 50062))
            await wait_until(lambda: len(server.streams()) == 1)
            counters = server.counters()
            assert (counters["malformed_messages"], counters["internal_errors"]) == (2, 0)
            assert [e["engine"] for e in server.engines()] == ["raw"]
            await engine.close()

    run_async(scenario())


def test_stream_messages_before_hello_are_dropped(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            engine = await RawEngine.connect(socket_path)
            await engine.send(
                _open("early", 50070),
                Update(request_id="early", kv_blocks=3, tokens_out=1),
                Close(request_id="early", reason="finished"),
            )
            await wait_until(lambda: server.counters()["before_hello_messages"] == 3)
            assert server.streams() == []
            await engine.send(_hello(), _open("on-time", 50071))
            assert isinstance(await engine.receive(), Welcome)
            await wait_until(lambda: len(server.streams()) == 1)
            await engine.close()

    run_async(scenario())


def test_unknown_version_hello_gets_an_error_and_is_closed(socket_path: str) -> None:
    hello_v2 = encode(_hello()).replace(b'"v":1', b'"v":2')

    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            newer = await RawEngine.connect(socket_path)
            await newer.send(hello_v2)
            error = await newer.receive()
            assert isinstance(error, ErrorMessage)
            assert "protocol version 2 is not supported" in error.message
            assert error.hint
            assert await newer.at_eof()

            engine = await _raw_session(socket_path)  # in a session: counted and dropped only
            await engine.send(hello_v2, _open("still-up", 50080))
            await wait_until(lambda: len(server.streams()) == 1)
            assert server.counters()["version_mismatches"] == 2
            assert server.connection_count() == 1
            await engine.close()

    run_async(scenario())


def test_a_new_hello_resets_the_session_and_duplicates_replace(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path) as (server, changes):
            engine = await _raw_session(socket_path)
            await engine.send(_open("a", 50090, kv_blocks=2), _open("b", 50091))
            await wait_until(lambda: len(server.streams()) == 2)
            first = server.find(LOCAL, Endpoint("127.0.0.1", 50090))
            await engine.send(_open("a", 50090, kv_blocks=5))
            await wait_until(
                lambda: changes.calls[-1][1] is not None and changes.calls[-1][1].kv_blocks == 5
            )
            again = server.find(LOCAL, Endpoint("127.0.0.1", 50090))
            assert first is not None and again is not None
            assert again.opened_ns == first.opened_ns
            await engine.send(
                Update(request_id="ghost", kv_blocks=1, tokens_out=1),
                Close(request_id="ghost", reason="finished"),
            )
            await wait_until(lambda: server.counters()["unknown_request_events"] == 2)

            await engine.send(_hello(), _open("c", 50092))
            assert isinstance(await engine.receive(), Welcome)
            await wait_until(lambda: [s.request_id for s in server.streams()] == ["c"])
            assert sorted(changes.removed()) == ["a", "b"]
            counters = server.counters()
            assert (counters["duplicate_opens"], counters["session_resets"]) == (1, 1)
            await engine.close()

    run_async(scenario())


def test_a_request_id_belongs_to_the_connection_that_opened_it_last(socket_path: str) -> None:
    """What an engine reconnecting before the agent saw its old connection end looks like."""

    async def scenario() -> None:
        async with running_server(socket_path) as (server, changes):
            old = await _raw_session(socket_path)
            await old.send(_open("moved", 50095, kv_blocks=2))
            await wait_until(lambda: len(server.streams()) == 1)
            new = await _raw_session(socket_path)
            await new.send(_open("moved", 50095, kv_blocks=4))
            await wait_until(lambda: server.counters()["duplicate_opens"] == 1)
            await old.send(Close(request_id="moved", reason="finished"))
            await wait_until(lambda: server.counters()["unknown_request_events"] == 1)
            await old.close()
            await wait_until(lambda: server.counters()["disconnects"] == 1)
            [stream] = server.streams()
            assert (stream.request_id, stream.kv_blocks) == ("moved", 4)
            assert changes.removed() == []
            await new.close()

    run_async(scenario())


def test_a_failing_on_change_callback_is_counted_and_serving_continues(socket_path: str) -> None:
    def broken(request_id: str, stream: EngineStream | None) -> None:
        raise RuntimeError("daemon bug")

    async def scenario() -> None:
        server = HookServer(socket_path, (os.geteuid(),), on_change=broken)
        await server.start()
        try:
            engine = await _raw_session(socket_path)
            await engine.send(_open("x", 50096), Update(request_id="x", kv_blocks=3, tokens_out=2))
            await wait_until(lambda: server.counters()["callback_errors"] == 2)
            [stream] = server.streams()
            assert stream.kv_blocks == 3
            await engine.close()
        finally:
            await server.close()

    run_async(scenario())


def test_engine_pid_follows_the_kernel_across_pid_namespaces(socket_path: str) -> None:
    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            contained = await RawEngine.connect(socket_path)  # says pid 1, like in a container
            await contained.send(_hello(pid=1), _open("ns", 50100, pid=1))
            proxy = await _raw_session(socket_path)  # same namespace, announces for a worker
            await proxy.send(_open("worker", 50101, pid=777))
            await wait_until(lambda: len(server.streams()) == 2)
            ns = server.find(LOCAL, Endpoint("127.0.0.1", 50100))
            worker = server.find(LOCAL, Endpoint("127.0.0.1", 50101))
            assert ns is not None and worker is not None
            assert (ns.engine_pid, ns.announced_pid) == (os.getpid(), 1)
            assert (worker.engine_pid, worker.announced_pid) == (777, 777)
            pids = sorted((e["pid"], e["hello_pid"]) for e in server.engines())
            assert pids == sorted([(os.getpid(), 1), (os.getpid(), os.getpid())])
            await contained.close()
            await proxy.close()

    run_async(scenario())


@needs_root
def test_unauthorised_uid_is_refused_with_an_error(socket_path: str) -> None:
    async def scenario() -> None:
        async with (
            running_server(socket_path, allowed_uids=()) as (server, _),
            engine_hook(socket_path) as hook,
        ):
            os.chown(socket_path, -1, NOBODY_UID)  # the engine group may open the socket
            reply = await asyncio.to_thread(
                exchange_as_uid, socket_path, NOBODY_UID, encode(_hello())
            )
            [error] = LineFramer(sender="agent").feed(reply)
            assert isinstance(error, ErrorMessage), reply
            assert error.message == f"uid {NOBODY_UID} may not use the kvwatch engine socket"
            assert error.hint.startswith("run the engine as a uid")
            counters = server.counters()
            assert (counters["peers_refused"], counters["connections_accepted"]) == (1, 1)
            hook.stream_opened("root-engine", SERVER, _client(50110), kv_blocks=1)
            await wait_until(lambda: len(server.streams()) == 1)  # root is always allowed

    run_async(scenario())


def test_agent_restart_engine_reannounces_within_two_seconds(socket_path: str) -> None:
    async def scenario() -> None:
        async with engine_hook(socket_path, reconnect_seconds=1.0) as hook:
            opened_ns = time.monotonic_ns()
            async with running_server(socket_path) as (server, _):
                hook.stream_opened("live-1", SERVER, _client(50120), kv_blocks=4)
                hook.stream_opened("live-2", SERVER, _client(50121), kv_blocks=2)
                await wait_until(lambda: len(server.streams()) == 2)
                hook.stream_updated("live-1", kv_blocks=6, tokens_out=80)
                await wait_until(lambda: server.streams()[0].kv_blocks == 6)
                await asyncio.sleep(0.5)  # deliberate: the streams are 0.5 s old at the restart
            restarted = time.monotonic()
            async with running_server(socket_path) as (server, _):
                await wait_until(lambda: len(server.streams()) == 2, timeout_seconds=2.0)
                elapsed = time.monotonic() - restarted
                stream = server.find(LOCAL, Endpoint("127.0.0.1", 50120))
                assert stream is not None
                assert (stream.kv_blocks, stream.tokens_out) == (6, 80)
                assert elapsed < 2.0
                # The re-announced stream keeps its age (open.age_ms), to the millisecond.
                assert abs(stream.opened_ns - opened_ns) < 100_000_000, stream

    run_async(scenario())


def test_an_engine_that_reads_nothing_never_blocks_the_agent(socket_path: str) -> None:
    big_evidence = {"blob": "x" * 60_000}

    async def scenario() -> None:
        async with running_server(socket_path) as (server, _):
            engine = await _raw_session(socket_path)  # from now on it reads nothing
            await engine.send(_open("deaf", 50130))
            await wait_until(lambda: len(server.streams()) == 1)
            started = time.monotonic()
            outcomes = await asyncio.gather(
                *(server.command("cancel", "deaf", "stalled", big_evidence, 3.0) for _ in range(16))
            )
            assert time.monotonic() - started < 1.0
            assert {o.status for o in outcomes} == {"failed"}
            counters = server.counters()
            assert counters["send_overflows"] == 1
            assert counters["cancels_lost"] + counters["cancel_send_failures"] >= 1
            await wait_until(lambda: server.connection_count() == 0)
            assert server.streams() == []
            await engine.close()

    run_async(scenario())
