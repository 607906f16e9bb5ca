"""Park and resume, end to end (docs/agent.md, "Park"): the reference engine in a server
namespace, the agent enforcing on the host with real BPF, clients across a link with MSS 1448
and the kernel's default receive buffers. A client that stops reading is parked at
`park_seconds` of its back-pressure, its KV freed as soon as the engine is held (seconds,
long before any proof), and is cut only after the reader-rate proof; live readers at 4 and
8 KB/s and one that pauses for 10 s are never cut and each receives exactly what an
unparked request sends; an engine without the feature is only ever cut, as before."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.metrics_text import metric_value
from tests.waiting import wait_until

from .conftest import SERVER_PORT, Agent
from .engine_lab import MAX_TOKENS, EngineLab, Stream, engine_lab, parse_stream
from .netlab import Link
from .readers import Reader

__all__ = ["engine_lab"]  # the fixture
PARK_SECONDS = 2.0


def start_agent(agent: Agent, lab: EngineLab, *args: str) -> None:
    agent.hook_socket = lab.hook_socket
    agent.start_agent(
        "--mode", "enforce", "--grace-seconds", "0", "--park-seconds", str(PARK_SECONDS),
        "--max-cancels-per-minute", "1000", *args,
        port=SERVER_PORT, audit="audit.jsonl",
    )  # fmt: skip
    agent.wait_engine_connected()


def entries_for(agent: Agent, request_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in agent.audit_entries(kind) if e.get("request_id") == request_id]


def reference_stream(lab: EngineLab) -> Stream:
    """What an unparked request sends: a reader that keeps up, to the end."""
    reader = lab.request(Reader("reference", "default", 1 << 24), "reference")
    wait_until(lambda: reader.ended_ns != 0, timeout_seconds=60)
    stream = parse_stream(reader.received)
    assert stream.done and stream.tokens == MAX_TOKENS, stream
    return stream


@pytest.mark.parametrize(
    "link",
    [Link(), Link(delay_ms=25, loss_percent=1.0)],
    ids=lambda link: link.describe().replace(" ", "-").replace(",", ""),
)
def test_stopped_reader_parked_in_seconds_cut_after_proof_live_readers_whole(
    agent: Agent, engine_lab: Any, link: Link
) -> None:
    lab: EngineLab = engine_lab(link)  # MTU 1500, MSS 1448
    start_agent(agent, lab)
    expected = reference_stream(lab)
    stopped = lab.request(Reader("stopped", "default", 0, read_seconds=0), "stopped")
    live = [
        lab.request(Reader("reader-4k", "default", 4096), "reader-4k"),
        lab.request(Reader("reader-8k", "default", 8192), "reader-8k"),
        lab.request(
            Reader("paused", "autotuned", 1 << 20, pause_after=0.2, pause_seconds=10), "paused"
        ),
    ]

    # The stopped reader's KV is freed by a park, long before any proof could come.
    request_id = "cmpl-stopped"

    def parked() -> dict[str, Any] | None:
        return next(
            (e for e in entries_for(agent, request_id, "outcome")
             if e["result"]["status"] == "parked"),
            None,
        )  # fmt: skip

    wait_until(parked, timeout_seconds=40)
    (decision,) = entries_for(agent, request_id, "decision")[:1]
    outcome = parked()
    assert outcome is not None and outcome["action"] == "park"
    assert (decision["verdict"], decision["actions"]) == ("act", ["park"]), decision
    assert outcome["result"]["freed_blocks"] > 0
    pressure_seconds = decision["evidence"]["stalled_seconds"]
    took_seconds = (outcome["monotonic_ns"] - decision["monotonic_ns"]) / 1e9
    print(f"park after {pressure_seconds:.2f} s of back-pressure, freed {took_seconds:.2f} s "
          f"later (attempt {outcome['result']['attempt']})")  # fmt: skip
    # The park is decided at park_seconds of back-pressure. The engine accepts it once its
    # client holds it: its non-blocking writer is held only when its socket's whole send
    # buffer is queued (back-pressure counts from 2/3, or from the zero window), then its
    # 16 KB in user space. Under this engine's output rate, with four streams sharing it,
    # that took 0 to 8 s and more in runs on this 2-core machine (bench/bench_time_to_free.py
    # measures the p99 on an idle one: park_seconds + 0.04 s). The agent asks again for
    # ~32 s; the test holds the freeing to well before any proof could come.
    assert PARK_SECONDS <= pressure_seconds < PARK_SECONDS + 0.5
    freed_after = pressure_seconds + took_seconds
    assert freed_after < min(PARK_SECONDS + 20.0, decision["evidence"]["stall_required_seconds"])
    assert stopped.reset_ns == 0, "parking cuts no one"
    row = next(r for r in agent.streams() if r["request_id"] == request_id)
    assert row["parked"] and row["kv_blocks"] == 0 and row["parked_kv_bytes"] > 0

    # Then the proof, and the cut: cancel (nothing left to free) and the reset.
    wait_until(lambda: stopped.reset_ns != 0, timeout_seconds=90)
    cut = [e for e in entries_for(agent, request_id, "decision") if e["reason"] == "stalled"]
    assert cut and cut[0]["verdict"] == "act", entries_for(agent, request_id, "decision")

    # Every live reader got the whole stream, byte for byte what an unparked one got.
    wait_until(lambda: all(r.ended_ns for r in live), timeout_seconds=150)
    for reader in live:
        assert reader.reset_ns == 0, f"{reader.name} was cut"
        got = parse_stream(reader.received)
        assert got == expected, f"{reader.name}: {got.tokens} tokens, done={got.done}"
        cuts = [
            e
            for e in entries_for(agent, f"cmpl-{reader.name}", "decision")
            if e["verdict"] == "act" and e["actions"] != ["park"]
        ]
        assert not cuts, f"{reader.name} would have been cut: {cuts}"
    # A live reader the engine parked while it was held resumed before its stream went on.
    parked_live = [
        e
        for reader in live
        for e in entries_for(agent, f"cmpl-{reader.name}", "outcome")
        if e["result"]["status"] == "parked"
    ]
    resumed = metric_value(agent.metrics(), "kvwatch_parks_resumed_total")
    print(f"live readers parked {len(parked_live)} times, resumed {resumed:.0f}")
    assert resumed >= len(parked_live)


def test_an_engine_that_cannot_park_is_never_parked(agent: Agent, engine_lab: Any) -> None:
    lab: EngineLab = engine_lab(Link(), "--no-park")
    start_agent(agent, lab)
    lab.request(Reader("stopped", "default", 0, read_seconds=0), "stopped")
    wait_until(
        lambda: any(
            r["request_id"] == "cmpl-stopped" and r["stalled_seconds"] > PARK_SECONDS + 2
            for r in agent.streams()
        ),
        timeout_seconds=30,
    )
    row = next(r for r in agent.streams() if r["request_id"] == "cmpl-stopped")
    assert row["parked"] is False and row["kv_blocks"] > 0, row
    assert not [e for e in agent.audit_entries("decision") if e["actions"] == ["park"]]
    engines = httpx.get(f"{agent.agent_url}/healthz", timeout=5).json()["engines"]
    assert engines and all(not engine["features"] for engine in engines), engines
