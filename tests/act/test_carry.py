"""Carrying decisions out (kvwatch.act.carry), with their real
collaborators (hook server, engine hook, joiner, actions, audit log, stalled connections):
one decision per stall episode, the budget given back when an action takes no effect, a
failed action tried again within its episode."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Awaitable, Callable

from kvwatch.act.actions import Actions
from kvwatch.act.audit import AuditLog
from kvwatch.act.carry import RETRY_DELAYS_SECONDS
from kvwatch.collect.gpu import GpuInventory
from kvwatch.collect.procfs import Procfs
from kvwatch.config.schema import PolicyConfig
from kvwatch.hook import CommandHandler, CommandOutcome
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.join import Joiner
from kvwatch.streams.relay import RelayIndex
from kvwatch.streams.states import StallJudgement, StallThresholds, judge
from kvwatch.streams.timeline import Timelines
from tests.act.pipeline import Pipeline
from tests.act.stalled import StalledConnections
from tests.hookserver.conftest import (
    BYTES_PER_BLOCK,
    engine_hook,
    run_async,
    running_server,
    wait_until,
)

POLICY = PolicyConfig(mode="enforce", actions=("reset",), grace_seconds=0, max_cancels_per_minute=1)
S = 1_000_000_000


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stalled_sample(bytes_acked: int = 1000) -> SocketSample:
    """A socket of this process (a connection that does not exist: a reset finds nothing),
    stalled for a minute with its peer silent."""
    now = time.monotonic_ns()
    since = now - 60 * S
    return SocketSample(
        key=7, source="bpf", observed_ns=now, local=Endpoint("127.0.0.1", unused_port()),
        remote=Endpoint("127.0.0.1", 40000), netns=0, inode=0, pid=os.getpid(),
        comm="python", tcp_state=1, wmem_queued=9000, sndbuf=9000, notsent_bytes=4096,
        unacked_bytes=0, peer_rwnd=0, srtt_us=100, snd_cwnd=10, retransmits=0,
        zero_window_probes=0, zero_window_episodes=1, zero_window_since_ns=since,
        zero_window_total_ns=0, last_zero_window_end_ns=0, sndbuf_full_episodes=0,
        sndbuf_full_since_ns=0, progress_ns=since, first_seen_ns=since,
        bytes_acked=bytes_acked, peer_rwnd_max=4096, rto_us=200_000, last_ack_ns=since,
    )  # fmt: skip


def verdict(sample: SocketSample) -> StallJudgement:
    judgement = judge(sample, time.monotonic_ns(), StallThresholds.of_policy(POLICY))
    assert judgement.stalled
    return judgement


async def with_decider(socket_path: str, scenario: Callable[[Pipeline], Awaitable[None]]) -> None:
    hooks = HookServer(socket_path, (os.geteuid(),))
    await hooks.start()
    actions = Actions(hooks, "/proc", lease_ms=10_000)
    decider = Pipeline(
        POLICY,
        lambda sample: RelayIndex(()).behind(sample, hooks),
        Joiner(Procfs(), GpuInventory()),
        actions,
        AuditLog(None, echo=None),
        Timelines(16),
    )
    try:
        await scenario(decider)
    finally:
        actions.close()
        await hooks.close()


def test_a_socket_the_kernel_no_longer_has_is_not_acted_on_and_keeps_the_budget(
    socket_path: str,
) -> None:
    async def scenario(decider: Pipeline) -> None:
        gone = stalled_sample()  # the record of a connection that does not exist
        assert await decider.on_stalled(gone, verdict(gone)) is None
        assert dict(decider.decisions) == {("skip", "socket_gone"): 1}
        assert not decider.actions.tally.outcomes
        assert decider.budget.remaining(time.monotonic()) == 1

    run_async(with_decider(socket_path, scenario))


def test_one_decision_per_episode(
    socket_path: str, stalled_connections: StalledConnections
) -> None:
    async def scenario(decider: Pipeline) -> None:
        sample = stalled_connections.sample(key=7, pid=os.getpid())
        assert await decider.on_stalled(sample, verdict(sample)) is None
        assert await decider.on_stalled(sample, verdict(sample)) is None  # same episode
        assert dict(decider.decisions) == {("act", "stalled"): 1}
        assert decider.actions.tally.outcomes["reset", "stalled", "reset"] == 1
        outcomes = [e for e in decider.events if e["kind"] == "outcome"]
        decisions = [e for e in decider.events if e["kind"] == "decision"]
        assert [o["decision_id"] for o in outcomes] == [d["decision_id"] for d in decisions]
        assert decisions[0]["evidence"]["kernel"]["tcp_state"] == "ESTABLISHED"

    run_async(with_decider(socket_path, scenario))


def test_a_socket_without_an_owner_is_looked_at_again_not_acted_on(socket_path: str) -> None:
    async def scenario(decider: Pipeline) -> None:
        orphan = stalled_sample().with_changes(pid=0, comm="")
        assert await decider.on_stalled(orphan, verdict(orphan)) == 1.0
        assert await decider.on_stalled(orphan, verdict(orphan)) == 1.0
        assert dict(decider.decisions) == {("skip", "owner_unknown"): 1}
        assert not decider.actions.tally.outcomes

    run_async(with_decider(socket_path, scenario))


def failing_then(ok_after: int) -> CommandHandler:
    """An engine's cancel handler that fails its first `ok_after` calls (its device work
    did not finish in time, say), then frees the request."""
    calls: list[str] = []

    def handler(request_id: str, reason: str) -> CommandOutcome:
        calls.append(request_id)
        if len(calls) <= ok_after:
            return CommandOutcome(request_id, "failed", 0, 0, detail="device work timed out")
        return CommandOutcome(request_id, "cancelled", 2, 2 * BYTES_PER_BLOCK)

    return handler


async def cancel_on_stall(
    socket_path: str, connections: StalledConnections, ok_after: int, tries: int
) -> tuple[Pipeline, list[float | None], SocketSample]:
    """A stalled stream of a real engine hook, cancelled through the decider: `tries` calls
    of the stall timers' handler, their answers, and the stalled record."""
    policy = PolicyConfig(mode="enforce", actions=("cancel",), grace_seconds=0)
    handler = failing_then(ok_after)
    answers: list[float | None] = []
    async with running_server(socket_path) as (hooks, _), engine_hook(socket_path, handler) as hook:
        actions = Actions(hooks, "/proc", lease_ms=10_000)
        decider = Pipeline(
            policy,
            lambda sample: RelayIndex(()).behind(sample, hooks),
            Joiner(Procfs(), GpuInventory()),
            actions,
            AuditLog(None, echo=None),
            Timelines(16),
        )
        sample = connections.sample(key=7, pid=os.getpid())
        hook.stream_opened(
            "cmpl-retry",
            (sample.local.ip, sample.local.port),
            (sample.remote.ip, sample.remote.port),
            2,
        )
        await wait_until(lambda: hooks.live("cmpl-retry"))
        for _ in range(tries):
            answers.append(await decider.on_stalled(sample, verdict(sample)))
        actions.close()
    return decider, answers, sample


def test_a_failed_cancel_is_tried_again_within_the_episode_and_charged_once(
    socket_path: str, stalled_connections: StalledConnections
) -> None:
    async def scenario() -> None:
        decider, answers, sample = await cancel_on_stall(
            socket_path, stalled_connections, ok_after=1, tries=2
        )
        assert answers == [RETRY_DELAYS_SECONDS[0], None]
        assert dict(decider.decisions) == {("act", "stalled"): 1}
        outcomes = [e for e in decider.events if e["kind"] == "outcome"]
        assert [(o["status"], o["attempt"]) for o in outcomes] == [
            ("failed", 1),
            ("cancelled", 2),
        ]
        assert decider.budget.remaining(time.monotonic()) == decider.budget.per_minute - 1
        assert decider.failure_of(sample) is None

    run_async(scenario())


def test_an_action_that_fails_every_try_is_shown_failed_and_gives_its_budget_back(
    socket_path: str, stalled_connections: StalledConnections
) -> None:
    async def scenario() -> None:
        tries = len(RETRY_DELAYS_SECONDS) + 1
        decider, answers, sample = await cancel_on_stall(
            socket_path, stalled_connections, ok_after=99, tries=tries + 1
        )
        assert answers == [*RETRY_DELAYS_SECONDS, None, None]  # the last call: done
        outcomes = [e for e in decider.events if e["kind"] == "outcome"]
        assert [o["attempt"] for o in outcomes] == list(range(1, tries + 1))
        assert {o["status"] for o in outcomes} == {"failed"}
        failure = decider.failure_of(sample)
        assert failure is not None and failure["actions"] == ["cancel"]
        assert failure["tries"] == tries and failure["request_id"] == "cmpl-retry"
        assert decider.budget.remaining(time.monotonic()) == decider.budget.per_minute

    run_async(scenario(), timeout_seconds=60)
