"""Stalls older than the agent: recognised from the kernel's own clocks (the persist timer)
by `kvwatch sockets`, `top --standalone` and a (re)starting agent, with deny rules holding for
them; and one decision per stall episode when many stall at once."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvwatch.lab.labs import SERVER_PORT, Agent, Lab
from kvwatch.lab.netlab import Link
from kvwatch.lab.readers import Reader
from kvwatch.lab.waiting import wait_for

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

STALLED_BEFORE_SECONDS = 10.0
# The token server runs as `python -m ...` from the virtualenv: its comm.
SERVER_COMM = "python"


def stalled_client(labs: Callable[[Link], Lab]) -> Reader:
    """A client with a 4 KB buffer that never reads: its stall is due after stall_seconds."""
    return labs(Link()).connect(Reader("never-4k", "4k", 0, read_seconds=0))


def acts_on(agent: Agent, reader: Reader) -> list[dict[str, object]]:
    return [entry for entry in agent.acts() if entry["remote"] == reader.local]


def decisions_on(agent: Agent, reader: Reader) -> list[dict[str, Any]]:
    return [e for e in agent.audit_entries("decision") if e["remote"] == reader.local]


def wait_for_act(agent: Agent, reader: Reader, timeout_seconds: float) -> dict[str, object]:
    found = wait_for(
        lambda: acts_on(agent, reader), timeout_seconds, f"an action on {reader.local}", 0.05
    )
    return found[0]


def test_an_old_stall_is_stalled_at_once_for_the_tools_and_the_agent(
    labs: Callable[[Link], Lab], agent: Agent
) -> None:
    reader = stalled_client(labs)
    time.sleep(STALLED_BEFORE_SECONDS)  # deliberate: the stall is this old when first looked at

    rows = [r for r in agent.sockets_json("--standalone") if r["remote"] == reader.local]
    assert len(rows) == 1, rows
    assert rows[0]["state"] == "stalled", rows[0]
    assert rows[0]["stalled_seconds"] >= STALLED_BEFORE_SECONDS - 3, rows[0]
    top = agent.cli("top", "--once", "--standalone", "--port", str(SERVER_PORT))
    assert re.search(rf"{reader.local.split(':')[1]}.*stalled", top), top

    # Its owner's comm denied: never acted on, and the decision names the real owner.
    agent.start(env={"KVWATCH_POLICY_DENY_COMMS": SERVER_COMM})
    wait_for(lambda: decisions_on(agent, reader), 10, f"a decision on {reader.local}", 0.1)
    time.sleep(2)  # deliberate: room for an action (or another decision), were there one
    decisions = decisions_on(agent, reader)
    assert decisions and all(e["reason"] == "denied_by_rule" for e in decisions), decisions
    assert decisions[0]["evidence"]["pid"] != 0, decisions[0]
    assert decisions[0]["evidence"]["comm"] == SERVER_COMM, decisions[0]
    assert not reader.reset_ns
    agent.close()

    # Allowed: acted on within a second of the agent's start, not after a fresh threshold.
    agent.start()
    ready_ns = time.monotonic_ns()
    entry = wait_for_act(agent, reader, 10)
    assert int(entry["monotonic_ns"]) - ready_ns <= 1_000_000_000, entry  # type: ignore[call-overload]


def test_a_restarted_agent_does_not_wait_a_fresh_threshold(
    labs: Callable[[Link], Lab], agent: Agent
) -> None:
    stall_seconds = 6.0
    first = agent.start("--stall-seconds", str(stall_seconds))
    reader = stalled_client(labs)
    time.sleep(4.0)  # deliberate: killed mid-stall (the buffer filled within a second)
    assert not acts_on(agent, reader)
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait()
    agent.services.remove(first)

    # Restarted once the stall is due, with the default grace period: a stall older than
    # the agent is not a young stream, and is acted on within a scan.
    time.sleep(3.0)  # deliberate: the stall (4 s old at the kill) becomes due meanwhile
    agent.start("--stall-seconds", str(stall_seconds), "--grace-seconds", "2")
    ready_ns = time.monotonic_ns()
    entry = wait_for_act(agent, reader, stall_seconds + 2)
    waited = (int(entry["monotonic_ns"]) - ready_ns) / 1e9  # type: ignore[call-overload]
    assert waited < 1.5, f"the new agent waited {waited:.2f} s: {entry}"
    assert entry["evidence"]["stalled_seconds"] >= stall_seconds, entry  # type: ignore[index]

    # No engine announced it: `explain` finds it by the client's address, and its outcome
    # line names the decision.
    def explained_after_the_reset() -> dict[str, Any] | None:
        chain: dict[str, Any] = json.loads(
            agent.cli("explain", reader.local, "--url", agent.agent_url, "--json")
        )
        return chain if any(e["event"] == "reset_done" for e in chain["timeline"]) else None

    chain = wait_for(explained_after_the_reset, 10, "the reset in the reader's timeline", 0.1)
    events = {e["event"]: e for e in chain["timeline"]}
    assert chain["remote"] == reader.local and chain["request_id"] is None, chain
    assert events["decision"]["decision_id"] == entry["decision_id"], chain
    assert events["reset_done"]["status"] == "reset", chain
    outcome = next(e for e in agent.audit_entries("outcome") if e["remote"] == reader.local)
    assert outcome["decision_id"] == entry["decision_id"], outcome


def test_one_action_per_stall_episode_over_200_stalls(
    labs: Callable[[Link], Lab], agent: Agent
) -> None:
    lab = labs(Link())
    agent.start()
    readers = [lab.connect(Reader(f"never-{n}", "4k", 0, read_seconds=0)) for n in range(200)]
    deadline = time.monotonic() + 90
    while len({e["remote"] for e in agent.acts()}) < len(readers):
        assert time.monotonic() < deadline, f"{len(agent.acts())} of 200 acted on"
        time.sleep(0.5)
    while len(agent.audit_entries("outcome")) < len(readers):  # resets run one at a time
        assert time.monotonic() < deadline, f"{len(agent.audit_entries('outcome'))} resets done"
        time.sleep(0.5)
    time.sleep(3)  # deliberate: room for a second action, were there one
    acts = agent.acts()
    assert sorted(e["remote"] for e in acts) == sorted(r.local for r in readers)
    outcomes = agent.audit_entries("outcome")
    assert len(outcomes) == 200, outcomes
    assert {o["decision_id"] for o in outcomes} == {e["decision_id"] for e in acts}
    assert all(o["result"]["status"] == "reset" for o in outcomes), outcomes
    counted = re.search(
        r'kvwatch_policy_decisions_total\{reason="stalled",verdict="act"\} (\d+)', agent.metrics()
    )
    assert counted is not None and float(counted.group(1)) == 200


def test_fifty_stalls_older_than_the_agent_get_one_decision_each(
    labs: Callable[[Link], Lab], agent: Agent
) -> None:
    """The start-up sock_diag view and BPF both see each old stall: one decision each,
    whichever sees it first (observe mode: would_act is decided once per episode too)."""
    lab = labs(Link())
    readers = [lab.connect(Reader(f"old-{n}", "4k", 0, read_seconds=0)) for n in range(50)]
    time.sleep(4)  # deliberate: every buffer full, every stall due before the agent starts
    agent.start("--mode", "observe")
    deadline = time.monotonic() + 30

    def decided() -> set[str]:
        return {e["remote"] for e in agent.audit_entries("decision")}

    while len(decided()) < len(readers):
        assert time.monotonic() < deadline, f"{len(decided())} of 50 decided"
        time.sleep(0.5)
    time.sleep(3)  # deliberate: room for a second decision, were there one
    decisions = [e for e in agent.audit_entries("decision") if e["verdict"] == "would_act"]
    assert sorted(e["remote"] for e in decisions) == sorted(r.local for r in readers)
    assert not [r for r in readers if r.reset_ns]
