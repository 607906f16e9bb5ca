"""The agent drives vLLM, end to end: the session's real `vllm serve` (kvwatch's scheduler and
middleware, the deterministic executor; conftest.py) and `kvwatch run --mode enforce` from the
project's venv, with real BPF, watching the server's port with a hook socket and an API port
of its own. The clients are raw sockets with the kernel's default receive buffers, across a
veth pair from a namespace of their own (MTU 1500, MSS 1448: tests.support.network); the
middleware coalesces the streams (1 KB / 500 ms, its default).

All five clients run at once, started by the module's fixture; each test follows one:
- a client that stops reading after its first second is paused, then parked `park_seconds`
  later (its blocks back in vLLM's free pool, no token decoded while parked), and, reading
  again, is released and gets every token of the unheld answer, in order;
- a client that stops at its first bytes and never reads again (a dead one) is held the same
  way and cut once the stall is proven (the reader guarantee): the client gets a reset and
  vLLM aborts the request (its scheduler ends it FINISHED_ABORTED; vLLM 0.33's
  `vllm:request_success_total{finished_reason="abort"}` counts only aborts the engine reports,
  not the API server's, so the test reads the scheduler's record through `kv_state`);
- live readers slower than their streams (4 and 8 KB/s; a stream is ~35-45 KB/s here) are
  paced (paused and released as they fall behind and catch up), never cut, and get every
  token;
- a reader that keeps up is never held at all;
and every lease renewal the agent sent was taken.
Needs root (BPF) and the project's venv (`make setup`); skips without them, unless
KVWATCH_REQUIRE_BPF=1 (CI), where it fails.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import Agent, agent_unavailable_reason, kvwatch_agent
from tests.support.clients import Client, wait_for
from tests.support.network import ClientNetwork
from tests.support.server import VllmServer, control, stream_completion
from tests.support.tokens import expected_output

pytestmark = pytest.mark.server

REQUIRE_BPF_ENV = "KVWATCH_REQUIRE_BPF"
# The agent as a user runs it (`kvwatch run --mode enforce`: pause 2 s behind, park 2 s
# later, release under 1 s, cut on proof, cancel through the hook); only its watched port,
# hook socket, API port and audit log are the test's.
AGENT_ARGS = ("--mode", "enforce")
PARK_SECONDS = 2.0
BLOCK_TOKENS = 16
QUIET_SECONDS = 0.6  # how long a parked request is watched for tokens
SAMPLE_SECONDS = 0.05  # how often the engine's KV state is read while waiting for the park


@dataclass(frozen=True)
class Case:
    """One client: its X-Request-Id, its answer's length, how it reads."""

    request_id: str
    max_tokens: int
    rate: int | None = None
    stop_after: float | None = None

    @property
    def prompt(self) -> list[int]:
        """40 tokens of its own (no prefix shared with another client)."""
        base = 1000 * (1 + sum(map(ord, self.request_id)) % 30)
        return list(range(base, base + 40))

    @property
    def expected(self) -> list[int]:
        return expected_output(self.prompt, self.max_tokens)


RETURNING = Case("kvw-returning", 2000, stop_after=1.0)
DEAD = Case("kvw-dead", 3000, stop_after=0.0)
# ~35 s of reading each (about 230 bytes of SSE a token), the dead reader's proof as long.
SLOW = (Case("kvw-slow-4k", 600, rate=4096), Case("kvw-slow-8k", 1200, rate=8192))
HEALTHY = Case("kvw-healthy", 2000)
CASES = (RETURNING, DEAD, *SLOW, HEALTHY)


@dataclass
class KvSamples:
    """The engine's KV state as `kv_state` of one stream reads it, every SAMPLE_SECONDS on a
    thread, until `stop`: the free pool, the held requests, every live request's blocks."""

    server: VllmServer
    request_id: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> KvSamples:
        threading.Thread(target=self._run, name="kv-samples", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            state = control(self.server.control_path, "kv_state", self.request_id)
            if "error" not in state:
                self.samples.append(state)


@dataclass
class Run:
    agent: Agent
    server: VllmServer
    clients: dict[str, Client]
    engine_ids: dict[str, str]  # each client's vLLM request
    kv: KvSamples


@pytest.fixture(scope="module")
def agent(server: VllmServer, serve_dir: Path) -> Iterator[Agent]:
    reason = agent_unavailable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_BPF_ENV) == "1":
            pytest.fail(f"the agent cannot run: {reason} ({REQUIRE_BPF_ENV}=1 forbids skipping)")
        pytest.skip(reason)
    with kvwatch_agent(serve_dir, server.port, serve_dir / "engine.sock", *AGENT_ARGS) as running:
        yield running


@pytest.fixture(scope="module")
def network(agent: Agent) -> Iterator[ClientNetwork]:
    made = ClientNetwork()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def run(server: VllmServer, agent: Agent, network: ClientNetwork) -> Iterator[Run]:
    # The middleware's hook starts at the server's first request, then finds the agent.
    warm_up = stream_completion(server.port, "kvw-warm-up", list(range(1, 41)), 8)
    assert warm_up.done.wait(60) and warm_up.error is None, warm_up.error
    wait_for(agent.engines, 30, f"vLLM's hello on the agent's hook socket\n{agent.log_tail()}")
    (engine,) = agent.engines()
    assert engine["engine"] == "vllm" and {"pause", "park"} <= set(engine["features"]), engine
    kv = KvSamples(server, RETURNING.request_id).start()
    clients = {
        case.request_id: Client(case.request_id, case.rate, case.stop_after).start(
            network.socket(), network.server_ip, server.port, case.prompt, case.max_tokens
        )
        for case in CASES
    }
    try:
        wait_for(
            lambda: all(c.first_bytes_ns for c in clients.values()), 30, "the first bytes of all"
        )
        engine_ids = {
            request_id: control(server.control_path, "kv_state", request_id)["engine_ids"][0]
            for request_id in clients
        }
        yield Run(agent, server, clients, engine_ids, kv)
    finally:
        kv.stop.set()
        for client in clients.values():
            client.close()


def seconds_between(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e9, 2)


def cut_decision(agent: Agent, request_id: str) -> dict[str, Any]:
    return next(d for d in agent.audit("decision", request_id) if d["reason"] == "stalled")


def test_a_reader_that_stops_is_paused_then_parked_and_resumes_whole(run: Run) -> None:
    agent, client, rid = run.agent, run.clients[RETURNING.request_id], RETURNING.request_id
    park = wait_for(
        lambda: agent.outcome(rid, "park", "parked"),
        60,
        f"the park of {rid}: {agent.outcomes(rid)}",
    )
    pause = agent.outcome(rid, "pause", "paused")
    assert pause is not None and agent.outcomes(rid)[:2] == [
        ("pause", "paused"),
        ("park", "parked"),
    ]
    reasons = [(d["verdict"], d["reason"]) for d in agent.audit("decision", rid)][:2]
    assert reasons == [("act", "reader_behind"), ("act", "reader_still_behind")], reasons
    assert client.stopped_ns and client.reset_ns == 0
    paused_after = seconds_between(client.stopped_ns, pause["monotonic_ns"])
    parked_after = seconds_between(client.stopped_ns, park["monotonic_ns"])
    assert parked_after - paused_after >= PARK_SECONDS - 0.1

    # The park gave vLLM's free pool exactly the blocks the paused request held.
    wait_for(
        lambda: any(parked(s, rid) for s in run.kv.samples), 10, "a KV sample of the parked request"
    )
    run.kv.stop.set()
    before, after = around_the_park(run.kv.samples, rid)
    (engine_id,) = after["engine_ids"]
    held_blocks = before["blocks"][engine_id]
    assert held_blocks >= math.ceil(len(RETURNING.prompt) / BLOCK_TOKENS)
    assert park["result"]["freed_blocks"] == held_blocks
    assert after["blocks"][engine_id] == 0
    others = others_change(before["live_blocks"], after["live_blocks"], engine_id)
    assert after["free_blocks"] - before["free_blocks"] == held_blocks - others

    # Parked: no token decoded; the agent's view says so.
    tokens = control(run.server.control_path, "kv_state", rid)["output_tokens"][engine_id]
    time.sleep(QUIET_SECONDS)  # deliberate: nothing may be decoded for a parked request
    state = control(run.server.control_path, "kv_state", rid)
    assert state["output_tokens"][engine_id] == tokens < RETURNING.max_tokens
    assert state["held"].get(engine_id) == "parked"
    row = agent.stream(rid)
    assert row is not None and row["parked"] and row["kv_blocks"] == 0, row

    # It reads again: released, and it gets every token of the unheld answer, in order.
    read_again_ns = time.monotonic_ns()
    client.read_again()
    wait_for(lambda: client.done, 90, f"the end of {rid}'s answer")
    assert client.reset_ns == 0 and not client.error, client.error
    completion = client.completion()
    assert completion.token_ids == RETURNING.expected
    assert completion.finish_reason == "length" and completion.done
    release = agent.outcome(rid, "release", "released")
    assert release is not None, agent.outcomes(rid)
    print(  # the numbers docs/engines.md quotes (pytest -s)
        f"\n{rid}: stopped after {client.stopped_at_bytes} bytes; paused {paused_after} s and "
        f"parked {parked_after} s after its last read, {held_blocks} blocks freed "
        f"({park['result']['freed_bytes']} bytes; pool {before['free_blocks']} -> "
        f"{after['free_blocks']} of {after['total_blocks']}, others {-others:+d}); "
        f"{tokens} of {RETURNING.max_tokens} tokens decoded when parked; released "
        f"{seconds_between(read_again_ns, release['monotonic_ns'])} s after it read again"
    )


def test_a_dead_reader_is_cut_after_the_proof_and_vllm_aborts_it(run: Run) -> None:
    agent, client, rid = run.agent, run.clients[DEAD.request_id], DEAD.request_id
    cancel = wait_for(
        lambda: agent.outcome(rid, "cancel", "cancelled"),
        150,
        f"the cut of {rid}: {agent.outcomes(rid)}",
    )
    cut = cut_decision(agent, rid)
    assert (cut["verdict"], cut["reason"]) == ("act", "stalled"), cut
    held = [action for action, status in agent.outcomes(rid) if status in ("paused", "parked")]
    assert held[:2] == ["pause", "park"], agent.outcomes(rid)  # held while the proof came
    assert cancel["result"]["freed_blocks"] == 0, cancel  # its park had freed its KV
    wait_for(lambda: client.reset_ns, 10, f"the reset of {rid}'s connection")
    engine_id = run.engine_ids[rid]
    ended = wait_for(
        lambda: control(run.server.control_path, "kv_state", rid)["ended"].get(engine_id),
        10,
        f"vLLM's end of {engine_id}",
    )
    assert ended == "ended (FINISHED_ABORTED)"
    assert control(run.server.control_path, "pause", rid)["status"] == "unknown_request"
    print(
        f"\n{rid}: cut {seconds_between(client.stopped_ns, cancel['monotonic_ns'])} s after its "
        f"last read ({cut['detail']}); vLLM aborted it"
    )


@pytest.mark.parametrize("case", SLOW, ids=lambda case: case.request_id)
def test_slow_live_readers_are_paced_never_cut_and_get_every_token(run: Run, case: Case) -> None:
    agent, client, rid = run.agent, run.clients[case.request_id], case.request_id
    wait_for(lambda: client.done, 180, f"the end of {rid}'s answer")
    assert client.reset_ns == 0 and not client.error, client.error
    completion = client.completion()
    assert completion.token_ids == case.expected and completion.done
    cuts = [d for d in agent.audit("decision", rid) if d["reason"] == "stalled"]
    assert not cuts, cuts
    holds = [action for action, _ in agent.outcomes(rid)]
    assert set(holds) <= {"pause", "park", "release"}, holds
    assert not holds or holds[-1] == "release", holds  # every hold ended by the agent
    print(
        f"\n{rid}: {holds.count('pause')} pauses, {holds.count('park')} parks, "
        f"{holds.count('release')} releases; never cut; every token"
    )


def test_a_reader_that_keeps_up_is_never_held(run: Run) -> None:
    agent, client, rid = run.agent, run.clients[HEALTHY.request_id], HEALTHY.request_id
    wait_for(lambda: client.done, 120, f"the end of {rid}'s answer")
    assert client.reset_ns == 0 and not client.error, client.error
    assert client.completion().token_ids == HEALTHY.expected
    assert agent.audit("decision", rid) == [] and agent.outcomes(rid) == []


def parked(sample: dict[str, Any], request_id: str) -> bool:
    return "parked" in [sample["held"].get(e) for e in sample["engine_ids"]]


def around_the_park(
    samples: list[dict[str, Any]], request_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last sample with the request paused and the first with it parked, next to each
    other (a sample is one read between two engine steps)."""
    first = next(i for i, s in enumerate(samples) if parked(s, request_id))
    before = samples[first - 1]
    (engine_id,) = before["engine_ids"]
    assert before["held"].get(engine_id) == "paused", before
    return before, samples[first]


def others_change(before: dict[str, int], after: dict[str, int], engine_id: str) -> int:
    """The blocks the other live requests took (+) or gave back (-) between two samples."""
    names = (set(before) | set(after)) - {engine_id}
    return sum(after.get(name, 0) - before.get(name, 0) for name in names)


def test_the_agent_renews_every_hold_and_the_engine_takes_each_renewal(run: Run) -> None:
    """The agent renews a held request's lease with a pause, parked ones too, and vLLM's
    answer keeps it held (`paused`; it stays parked): no hold ran out under the agent."""
    wait_for(lambda: all(c.done for c in run.clients.values()), 180, "every client's end")
    renewed = run.agent.metric("kvwatch_holds_renewed_total")
    assert run.agent.metric("kvwatch_hold_renewals_refused_total") == 0
    assert renewed > 0  # the dead reader was held for longer than a lease
    print(f"\n{renewed:g} renewals, none refused")
