"""Park and resume over the real engine hook and hook server (docs/protocol.md, "Park and
resume"): the feature is announced in hello, a park's answer marks the stream parked, a
resume unmarks it with the blocks it holds again, and a re-announce keeps the state."""

from __future__ import annotations

import time

from kvwatch.hook import CommandOutcome, EngineHook
from tests.hookserver.conftest import (
    BYTES_PER_BLOCK,
    engine_hook,
    run_async,
    running_server,
    wait_until,
)

SERVER = ("127.0.0.1", 8000)
CLIENT = ("127.0.0.1", 50100)


def test_park_frees_blocks_keeps_the_stream_and_resume_brings_them_back(socket_path: str) -> None:
    hooks: list[EngineHook] = []

    def park(request_id: str, reason: str) -> CommandOutcome:
        assert reason == "backpressure"
        hooks[0].stream_updated(request_id, 0, 40)  # as the engine does once its blocks are free
        return CommandOutcome(request_id, "parked", 5, 5 * BYTES_PER_BLOCK)

    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, _),
            engine_hook(socket_path, park_handler=park) as hook,
        ):
            hooks.append(hook)
            hook.stream_opened("cmpl-p", SERVER, CLIENT, kv_blocks=5)
            await wait_until(lambda: len(server.streams()) == 1)
            (stream,) = server.streams()
            assert stream.can_park and not stream.parked
            assert server.engines()[0]["features"] == ["park"]

            outcome = await server.command(
                "park", "cmpl-p", "backpressure", {"pressure_seconds": 2.0}
            )
            assert outcome == CommandOutcome("cmpl-p", "parked", 5, 5 * BYTES_PER_BLOCK, "")
            await wait_until(lambda: server.streams()[0].kv_blocks == 0)
            assert server.streams()[0].parked, "a parked request stays announced, parked"

            hook.stream_resumed("cmpl-p", kv_blocks=6, recomputed_tokens=0)
            await wait_until(lambda: not server.streams()[0].parked)
            assert server.streams()[0].kv_blocks == 6
            counters = server.counters()
            assert (counters["parks_sent"], counters["parks_answered"], counters["resumes"]) == (
                1,
                1,
                1,
            )
            assert hook.counters()["parks_received"] == hook.counters()["parks_answered"] == 1

    run_async(scenario())


def test_a_reconnected_engine_re_announces_its_parked_request_as_parked(socket_path: str) -> None:
    async def scenario() -> None:
        park = lambda request_id, reason: CommandOutcome(request_id, "parked", 2, 2)  # noqa: E731
        async with engine_hook(socket_path, park_handler=park) as hook:
            hook.stream_opened("cmpl-r", SERVER, CLIENT, kv_blocks=2)
            async with running_server(socket_path) as (server, _):
                await wait_until(lambda: len(server.streams()) == 1)
                assert (
                    await server.command("park", "cmpl-r", "backpressure", {})
                ).status == "parked"
            async with running_server(socket_path) as (server, _):  # the agent restarted
                await wait_until(lambda: len(server.streams()) == 1)
                assert server.streams()[0].parked

    run_async(scenario())


def test_an_engine_without_the_feature_answers_a_park_failed_and_keeps_its_stream(
    socket_path: str,
) -> None:
    async def scenario() -> None:
        async with (
            running_server(socket_path) as (server, _),
            engine_hook(socket_path) as hook,
        ):
            hook.stream_opened("cmpl-n", SERVER, CLIENT, kv_blocks=2)
            await wait_until(lambda: len(server.streams()) == 1)
            assert not server.streams()[0].can_park
            outcome = await server.command("park", "cmpl-n", "backpressure", {})
            assert (outcome.status, outcome.freed_blocks) == ("failed", 0)
            assert "cannot park" in outcome.detail
            assert not server.streams()[0].parked

    run_async(scenario())


def test_a_request_that_resumes_before_its_park_is_answered_is_not_left_parked(
    socket_path: str,
) -> None:
    """The client read right after the park: the engine's `resumed` can leave before the
    `parked` answer (the answer waits for the handler's thread). Neither side may then think
    the request parked: the agent's registry, nor the hook's re-announce."""
    hooks: list[EngineHook] = []

    def park(request_id: str, reason: str) -> CommandOutcome:
        hooks[0].stream_resumed(request_id, kv_blocks=3, recomputed_tokens=0)  # read at once
        time.sleep(0.1)  # deliberate: the resumed goes out before this answer
        return CommandOutcome(request_id, "parked", 3, 3 * BYTES_PER_BLOCK)

    async def scenario() -> None:
        async with engine_hook(socket_path, park_handler=park) as hook:
            hooks.append(hook)
            hook.stream_opened("cmpl-q", SERVER, CLIENT, kv_blocks=3)
            async with running_server(socket_path) as (server, _):
                await wait_until(lambda: len(server.streams()) == 1)
                assert (
                    await server.command("park", "cmpl-q", "backpressure", {})
                ).status == "parked"
                assert not server.streams()[0].parked
            async with running_server(socket_path) as (server, _):  # re-announced
                await wait_until(lambda: len(server.streams()) == 1)
                assert not server.streams()[0].parked

    run_async(scenario())
