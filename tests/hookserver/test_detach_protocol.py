"""Detach over the real engine hook and hook server (docs/protocol.md, "Detach"): the feature
is announced in hello, a detach's answer carries the bytes buffered and marks the stream
detached, an update that reports the buffer full (coupled again) unmarks it — also when it
came before the answer — and a re-announce keeps the state."""

from __future__ import annotations

from kvwatch.hook import EngineHook
from kvwatch.hookwire.types import CommandOutcome
from tests.hookserver.conftest import engine_hook, run_async, running_server, wait_until

SERVER = ("127.0.0.1", 8000)
CLIENT = ("127.0.0.1", 50200)


def _detached(request_id: str, reason: str) -> CommandOutcome:
    return CommandOutcome(request_id, "detached", 0, 0, buffered_bytes=700)


def test_detach_answers_with_the_buffered_bytes_and_a_full_buffer_couples_again(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, _),
            engine_hook(socket_path, detach_handler=_detached) as hook,
        ):
            hook.stream_opened("cmpl-d", SERVER, CLIENT, kv_blocks=3)
            await wait_until(lambda: len(server.streams()) == 1)
            (stream,) = server.streams()
            assert stream.can_detach and not stream.detached and not stream.can_park
            assert server.engines()[0]["features"] == ["detach"]

            outcome = await server.command(
                "detach", "cmpl-d", "backpressure", {"pressure_seconds": 2.0}
            )
            assert outcome == CommandOutcome("cmpl-d", "detached", 0, 0, "", buffered_bytes=700)
            await wait_until(lambda: server.streams()[0].detached)
            assert server.streams()[0].kv_blocks == 3, "a detach frees nothing at once"

            hook.stream_updated("cmpl-d", 3, 90, egress_buffer_full=True)
            await wait_until(lambda: not server.streams()[0].detached)
            assert server.streams()[0].egress_buffer_full
            counters = server.counters()
            assert (counters["detaches_sent"], counters["detaches_answered"]) == (1, 1)
            hook_counters = hook.counters()
            assert hook_counters["detaches_received"] == hook_counters["detaches_answered"] == 1

    run_async(scenario())


def test_a_detach_answered_after_its_buffer_filled_leaves_the_stream_coupled(
    socket_path: str,
) -> None:
    """The engine reported the buffer full before its answer left: the update wins, on both
    sides (the agent's registry and the hook's re-announce)."""
    hooks: list[EngineHook] = []

    def fills_at_once(request_id: str, reason: str) -> CommandOutcome:
        hooks[0].stream_updated(request_id, 1, 5, egress_buffer_full=True)
        return _detached(request_id, reason)

    async def scenario() -> None:
        async with engine_hook(socket_path, detach_handler=fills_at_once) as hook:
            hooks.append(hook)
            hook.stream_opened("cmpl-f", SERVER, CLIENT, kv_blocks=1)
            async with running_server(socket_path) as (server, _):
                await wait_until(lambda: len(server.streams()) == 1)
                assert (
                    await server.command("detach", "cmpl-f", "backpressure", {})
                ).status == "detached"
                await wait_until(lambda: server.streams()[0].egress_buffer_full)
                assert not server.streams()[0].detached
            async with running_server(socket_path) as (server, _):  # the agent restarted
                await wait_until(lambda: len(server.streams()) == 1)
                assert not server.streams()[0].detached

    run_async(scenario())


def test_a_reconnected_engine_re_announces_its_detached_stream_as_detached(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with engine_hook(socket_path, detach_handler=_detached) as hook:
            hook.stream_opened("cmpl-r", SERVER, CLIENT, kv_blocks=2)
            async with running_server(socket_path) as (server, _):
                await wait_until(lambda: len(server.streams()) == 1)
                assert (
                    await server.command("detach", "cmpl-r", "backpressure", {})
                ).status == "detached"
            async with running_server(socket_path) as (server, _):  # the agent restarted
                await wait_until(lambda: len(server.streams()) == 1)
                assert server.streams()[0].detached

    run_async(scenario())


def test_detach_without_the_feature_fails_and_of_an_unknown_stream_sends_nothing(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, _),
            engine_hook(socket_path) as hook,
        ):
            hook.stream_opened("cmpl-n", SERVER, CLIENT, kv_blocks=2)
            await wait_until(lambda: len(server.streams()) == 1)
            assert not server.streams()[0].can_detach
            outcome = await server.command("detach", "cmpl-n", "backpressure", {})
            assert isinstance(outcome, CommandOutcome)
            assert (outcome.status, outcome.buffered_bytes) == ("failed", 0)
            assert "cannot detach" in outcome.detail
            assert not server.streams()[0].detached
            unknown = await server.command("detach", "cmpl-none", "backpressure", {})
            assert isinstance(unknown, CommandOutcome) and unknown.status == "unknown_request"
            counters = server.counters()
            assert (counters["detaches_sent"], counters["detaches_unknown_request"]) == (1, 1)

    run_async(scenario())
