"""The policy's decision and what act/ does with it (kvwatch.policy.decide,
kvwatch.act.carry, tests/act/pipeline.py) with their real collaborators: an audit log
in a file, timelines, a joiner over a procfs (a fixture tree with an engine in a Kubernetes
pod, or this process) and the fake NVML, actions over a hook server that is not started
(no engine is connected, so a cancel finds no one to ask), and real stalled loopback
connections, which the check before an action looks up in the kernel. What a user relies on: observe
mode never acts and audits what it would have done, spending the budget as enforce would;
deny rules hold whatever the mode; a cancel that changed nothing is audited with its outcome
and gives its budget unit back; and every decision is one audit line, with its evidence,
once per change of verdict or reason in a stall episode."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvwatch.act.actions import Actions
from kvwatch.act.audit import AuditLog
from kvwatch.collect.gpu import GpuInventory
from kvwatch.collect.procfs import Procfs
from kvwatch.config.schema import PolicyConfig
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.policy.decide import RECHECK_SECONDS
from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.join import Joiner
from kvwatch.streams.relay import RelayLink
from kvwatch.streams.states import judge
from kvwatch.streams.timeline import Timelines, connection_id
from tests.act.pipeline import Pipeline
from tests.act.stalled import StalledConnections
from tests.collect.conftest import GIB, FakeGpu, FakeNvml
from tests.hookserver.conftest import run_async

S = 1_000_000_000
ENGINE_PID = 4242
CID = "3f4c2b1a" * 8
POD = "7a1e9f3c-52b4-4d5e-9b1a-2c3d4e5f6a7b"
POD_CGROUP = (
    "/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope"
)
GPU_UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
DENIED_PORT = 9000
ENFORCE = PolicyConfig(mode="enforce", actions=("cancel",), grace_seconds=0)
OBSERVE = PolicyConfig(mode="observe", actions=("cancel", "reset"), grace_seconds=0)
# `kvwatch streams --json` (docs/contracts.md): what an audit line's evidence holds.
STREAM_KEYS = {
    "local", "remote", "pid", "comm", "state", "wmem_queued", "sndbuf", "notsent_bytes",
    "unacked_bytes", "peer_rwnd", "srtt_us", "retransmits", "zero_window",
    "zero_window_episodes", "zero_window_seconds", "sndbuf_full", "no_progress_seconds",
    "source", "request_id", "engine", "engine_pid", "kv_blocks", "kv_bytes", "gpu",
}  # fmt: skip


def stalled(connections: StalledConnections, key: int = 7, pid: int = ENGINE_PID) -> SocketSample:
    """An engine's server socket whose client stopped reading behind a zero window a minute
    ago: a real connection, as the kernel shows it."""
    return connections.sample(key, pid)


def announced(sample: SocketSample, age_seconds: float = 61.0, **flags: bool) -> EngineStream:
    """The request the engine announced on `sample`'s connection: 12 blocks of 16 KiB."""
    return EngineStream(
        request_id=f"cmpl-{sample.key}", engine_pid=sample.pid, announced_pid=1,
        engine="kvwatch-reference", model="tiny", device="cuda:0", local=sample.local,
        remote=sample.remote, kv_blocks=12, bytes_per_block=16384, tokens_out=300,
        opened_ns=time.monotonic_ns() - int(age_seconds * S), **flags,
    )  # fmt: skip


def fixture_procfs(root: Path) -> Procfs:
    """A procfs with one process: the engine, in a pod's container."""
    (root / str(ENGINE_PID)).mkdir(parents=True)
    (root / str(ENGINE_PID) / "comm").write_text("python3\n")
    (root / str(ENGINE_PID) / "cgroup").write_text(f"0::{POD_CGROUP}\n")
    return Procfs(str(root))


@dataclass
class Agent:
    """A Pipeline and what it writes to; `engines` are the requests `behind` finds, by socket."""

    decider: Pipeline
    hooks: HookServer
    audit_path: Path
    engines: dict[int, EngineStream]

    def audit_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit_path.read_text().splitlines()]

    async def stalled(self, sample: SocketSample) -> float | None:
        """The stall timers' call: the socket, with the judge's verdict on it now."""
        judgement = judge(sample, time.monotonic_ns(), self.decider.stall_thresholds)
        assert judgement.stalled
        return await self.decider.on_stalled(sample, judgement)


@contextlib.asynccontextmanager
async def running_agent(
    tmp_path: Path, socket_path: str, policy: PolicyConfig, procfs: Procfs | None = None
) -> AsyncIterator[Agent]:
    engines: dict[int, EngineStream] = {}

    def behind(sample: SocketSample) -> tuple[EngineStream | None, RelayLink | None]:
        return engines.get(sample.key), None

    nvml = FakeNvml([FakeGpu(GPU_UUID, "NVIDIA H100", 80 * GIB, 30 * GIB, [(ENGINE_PID, GIB)])])
    hooks = HookServer(socket_path, (os.geteuid(),))  # never started: no engine to ask
    actions = Actions(hooks, "/proc", lease_ms=10_000)
    audit_path = tmp_path / "audit" / "audit.jsonl"
    audit = AuditLog(str(audit_path), echo=None)
    joiner_procfs = procfs if procfs is not None else fixture_procfs(tmp_path / "proc")
    decider = Pipeline(
        policy,
        behind,
        Joiner(joiner_procfs, GpuInventory(nvml)),
        actions,
        audit,
        Timelines(16),
    )
    try:
        yield Agent(decider, hooks, audit_path, engines)
    finally:
        actions.close()
        audit.close()
        await hooks.close()


def test_observe_mode_never_acts_and_audits_what_it_would_have_done(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, OBSERVE) as agent:
            sample = stalled(stalled_connections)
            agent.engines[sample.key] = announced(sample, egress_buffer_full=True)
            assert await agent.stalled(sample) is None
            assert await agent.stalled(sample) is None  # the same episode: decided once
            (line,) = agent.audit_lines()
            assert (line["kind"], line["verdict"], line["reason"]) == (
                "decision",
                "would_act",
                "stalled",
            )
            assert line["actions"] == ["cancel", "reset"]
            assert line["request_id"] == "cmpl-7" and "0.2 MiB KV" in line["detail"]
            assert line["evidence"]["kv_bytes"] == 12 * 16384
            assert line["evidence"]["egress_buffer_full"] is True
            assert not agent.decider.actions.tally.outcomes
            counters = agent.hooks.counters()
            assert counters["cancels_sent"] == counters["cancels_unknown_request"] == 0
            assert not [e for e in agent.decider.events if e["kind"] == "outcome"]

    run_async(scenario())


def test_observe_mode_spends_the_budget_as_enforce_would(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    policy = PolicyConfig(mode="observe", actions=("reset",), grace_seconds=0,
                          max_cancels_per_minute=1)  # fmt: skip

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy) as agent:
            first, second = stalled(stalled_connections, key=7), stalled(stalled_connections, key=8)
            assert await agent.stalled(first) is None
            assert await agent.stalled(second) == RECHECK_SECONDS  # room may come back
            assert await agent.stalled(second) == RECHECK_SECONDS
            verdicts = [(line["verdict"], line["reason"]) for line in agent.audit_lines()]
            assert verdicts == [("would_act", "stalled"), ("skip", "budget_exhausted")]
            assert "max_cancels_per_minute" in agent.audit_lines()[1]["detail"]
            assert not agent.decider.actions.tally.outcomes

    run_async(scenario())


@pytest.mark.parametrize(
    ("rules", "named"),
    [
        ({"deny_ports": (DENIED_PORT,)}, "policy.deny_ports"),
        ({"deny_comms": ("py*",), "allow_comms": ("python3",)}, "policy.deny_comms 'py*'"),
        ({"deny_cgroups": (POD,)}, f"pod '{POD}' matches policy.deny_cgroups"),
        ({"deny_cgroups": ("*cri-containerd-*",)}, f"cgroup '{POD_CGROUP}'"),
    ],
    ids=["port", "comm-over-allow", "pod", "cgroup"],
)
def test_a_denied_stream_is_never_acted_on_even_in_enforce_mode(
    tmp_path: Path,
    socket_path: str,
    stalled_connections: StalledConnections,
    rules: dict[str, Any],
    named: str,
) -> None:
    policy = PolicyConfig(mode="enforce", actions=("cancel", "reset"), grace_seconds=0, **rules)

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy) as agent:
            sample = stalled(stalled_connections).with_changes(
                local=Endpoint("127.0.0.1", DENIED_PORT)
            )
            agent.engines[sample.key] = announced(sample)
            assert await agent.stalled(sample) is None  # denied for the whole episode
            assert await agent.stalled(sample) is None
            (line,) = agent.audit_lines()  # a long denied stall is one line
            assert (line["verdict"], line["reason"], line["actions"]) == (
                "skip",
                "denied_by_rule",
                [],
            )
            assert named in line["detail"]
            assert dict(agent.decider.decisions) == {("skip", "denied_by_rule"): 1}
            assert not agent.decider.actions.tally.outcomes
            assert agent.hooks.counters()["cancels_unknown_request"] == 0

    run_async(scenario())


def test_a_deny_rule_on_this_process_name_holds_for_its_sockets(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    comm = Procfs().comm(os.getpid())
    assert comm
    policy = PolicyConfig(mode="enforce", actions=("reset",), grace_seconds=0, deny_comms=(comm,))

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy, Procfs()) as agent:
            sample = stalled(stalled_connections, pid=os.getpid())
            assert await agent.stalled(sample) is None
            (line,) = agent.audit_lines()
            assert line["reason"] == "denied_by_rule" and repr(comm) in line["detail"]
            assert line["evidence"]["pid"] == os.getpid()
            assert not agent.decider.actions.tally.outcomes

    run_async(scenario())


def test_a_stream_outside_the_allow_lists_is_not_acted_on(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    policy = PolicyConfig(mode="enforce", actions=("cancel",), grace_seconds=0,
                          allow_cgroups=("*/other-pod*",))  # fmt: skip

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy) as agent:
            sample = stalled(stalled_connections)
            agent.engines[sample.key] = announced(sample)
            assert await agent.stalled(sample) is None
            (line,) = agent.audit_lines()
            assert (line["verdict"], line["reason"]) == ("skip", "not_allowed_by_rule")
            assert agent.hooks.counters()["cancels_unknown_request"] == 0

    run_async(scenario())


def test_a_cancel_no_engine_answers_is_audited_and_gives_its_budget_back(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, ENFORCE) as agent:
            sample = stalled(stalled_connections)
            agent.engines[sample.key] = announced(sample, kv_estimated=True)
            assert await agent.stalled(sample) is None
            decision, outcome = agent.audit_lines()
            assert (decision["verdict"], decision["actions"]) == ("act", ["cancel"])
            assert (outcome["kind"], outcome["action"]) == ("outcome", "cancel")
            assert outcome["decision_id"] == decision["decision_id"]
            assert outcome["request_id"] == decision["request_id"] == "cmpl-7"
            assert outcome["result"]["status"] == "unknown_request"
            assert outcome["result"]["freed_bytes"] == 0
            assert outcome["result"]["estimated"] is True  # the KV size was the hook's guess
            budget = agent.decider.budget
            assert budget.remaining(time.monotonic()) == ENFORCE.max_cancels_per_minute
            assert agent.hooks.counters()["cancels_unknown_request"] == 1
            timeline = agent.decider.timelines.of(connection_id(sample.local, sample.remote))
            events = [entry["event"] for entry in timeline.entries]
            assert events == ["decision", "cancel_acknowledged"]

    run_async(scenario())


def test_a_young_stream_is_looked_at_again_and_each_new_reason_is_one_line(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    policy = PolicyConfig(mode="observe", actions=("cancel",), grace_seconds=90)

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy) as agent:
            sample = stalled(stalled_connections)
            agent.engines[sample.key] = announced(sample, age_seconds=5)
            for _ in range(3):  # the timers look again every RECHECK_SECONDS
                assert await agent.stalled(sample) == RECHECK_SECONDS
            agent.engines[sample.key] = announced(sample, age_seconds=91)  # grace is over
            assert await agent.stalled(sample) is None
            reasons = [(line["verdict"], line["reason"]) for line in agent.audit_lines()]
            assert reasons == [("skip", "in_grace"), ("would_act", "stalled")]
            assert agent.decider.decisions == {("skip", "in_grace"): 1, ("would_act", "stalled"): 1}

    run_async(scenario())


def test_a_stall_older_than_its_announcement_is_not_in_grace(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    """An agent restarted mid-stall hears the engine announce the stream again, or not yet:
    the stall, a minute old by the kernel's clocks, is not a young stream either way."""
    policy = PolicyConfig(mode="observe", actions=("reset",), grace_seconds=30)

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy) as agent:
            sample = stalled(stalled_connections).with_changes(first_seen_ns=time.monotonic_ns())
            assert await agent.stalled(sample) is None
            (line,) = agent.audit_lines()
            assert (line["verdict"], line["reason"]) == ("would_act", "stalled")

    run_async(scenario())


def test_every_decision_is_one_audit_line_with_its_evidence(
    tmp_path: Path, socket_path: str, stalled_connections: StalledConnections
) -> None:
    policy = PolicyConfig(mode="observe", actions=("cancel", "reset"), grace_seconds=0,
                          deny_ports=(9000,))  # fmt: skip

    async def scenario() -> None:
        async with running_agent(tmp_path, socket_path, policy) as agent:
            hooked, unhooked = (
                stalled(stalled_connections, key=7),
                stalled(stalled_connections, key=8),
            )
            denied = stalled(stalled_connections, key=9).with_changes(
                local=Endpoint("127.0.0.1", DENIED_PORT)
            )
            agent.engines[hooked.key] = announced(hooked)
            for sample in (hooked, unhooked, denied, hooked, unhooked, denied):
                await agent.stalled(sample)
            lines = agent.audit_lines()
            assert [(line["local"], line["reason"]) for line in lines] == [
                (str(hooked.local), "stalled"),
                (str(unhooked.local), "stalled"),
                (f"127.0.0.1:{DENIED_PORT}", "denied_by_rule"),
            ]
            assert len({line["decision_id"] for line in lines}) == 3
            events = [e for e in agent.decider.events if e["kind"] == "decision"]
            assert [e["decision_id"] for e in events] == [line["decision_id"] for line in lines]
            for line in lines:
                evidence = line["evidence"]
                assert evidence.keys() >= STREAM_KEYS
                assert evidence["state"] == "stalled" and evidence["stalled_seconds"] >= 60
                assert evidence["stall_evidence"]["proof"] in ("answer", "silence")
                assert evidence["pod_uid"] == POD
                assert evidence["gpu"] == [{"index": 0, "uuid": GPU_UUID, "used_bytes": GIB}]
                assert line["ts"].endswith("Z") and line["monotonic_ns"] > 0
            hooked_line, unhooked_line, _ = lines
            assert hooked_line["evidence"]["request_id"] == "cmpl-7"
            assert hooked_line["actions"] == ["cancel", "reset"]
            assert unhooked_line["evidence"]["kv_bytes"] is None
            assert unhooked_line["actions"] == ["reset"]  # cancel needs the engine's hook
            assert "unknown KV" in unhooked_line["detail"]

    run_async(scenario())
