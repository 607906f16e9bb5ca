"""Reader-paced generation, end to end (docs/agent.md, "Pause, park, release"): the reference
engine with its defaults in a server namespace, the agent enforcing on the host with real
BPF, clients across a link with MSS 1448 and the kernel's default receive buffers. A client
that stops reading after its first second is paused once it is `pause_seconds` of its stream
behind, parked `park_seconds` later (its KV freed, nothing cut), and released when it reads
again: it receives exactly what an unpaused request sends, and the engine decoded only a few
seconds of tokens for nobody meanwhile. Live readers at 4 and 8 KB/s are paced, never cut,
byte for byte; a reader that keeps up is never paused; an engine that cannot pause or park is
only ever cut, as before."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvwatch.lab.labs import SERVER_PORT, Agent, EngineLab, Stream, parse_stream
from kvwatch.lab.netlab import Link
from kvwatch.lab.readers import Reader
from kvwatch.lab.waiting import wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.engine, pytest.mark.slow]
PAUSE_SECONDS = 2.0
PARK_SECONDS = 2.0
# A long answer (a reasoning model's): the one a reader that stops pins. With its first
# second read, most of it is still to be decoded when the reader's backlog shows.
LONG_TOKENS = 1900
# The live readers' answers: long enough that a 4 KB/s reader falls seconds behind its
# stream (~12 KB/s on a busy engine), short enough for it to finish in ~30 s.
LIVE_TOKENS = 600
# A reader that stopped after its first second: the tokens decoded after it stopped, in
# seconds of its stream's own pace, stay under this (the bench measures the p99).
DECODED_FOR_NOBODY_SECONDS = 12.0


def start_agent(agent: Agent, lab: EngineLab, *args: str) -> None:
    agent.hook_socket = lab.hook_socket
    agent.start_agent(
        "--mode", "enforce", "--grace-seconds", "0", "--pause-seconds", str(PAUSE_SECONDS),
        "--park-seconds", str(PARK_SECONDS), "--max-cancels-per-minute", "1000", *args,
        port=SERVER_PORT, audit="audit.jsonl",
    )  # fmt: skip
    agent.wait_engine_connected()


def entries_for(agent: Agent, request_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in agent.audit_entries(kind) if e.get("request_id") == request_id]


def actions_of(agent: Agent, request_id: str) -> list[tuple[str, str]]:
    """(action, status) of each outcome the agent wrote for the request, in order."""
    return [(e["action"], e["result"]["status"]) for e in entries_for(agent, request_id, "outcome")]


def reference_stream(lab: EngineLab, max_tokens: int) -> Stream:
    """What an unpaused request of `max_tokens` sends: a reader that keeps up, to the end."""
    name = f"reference-{max_tokens}"
    reader = lab.request(Reader(name, "default", 1 << 24), name, max_tokens)
    wait_until(lambda: reader.ended_ns != 0, timeout_seconds=60)
    stream = parse_stream(reader.received)
    assert stream.done and stream.tokens == max_tokens, stream
    report = lab.engine_request(f"cmpl-{name}")
    assert report["tokens_generated"] == max_tokens, report
    return stream


@pytest.mark.parametrize(
    "link",
    [Link(), Link(delay_ms=25, loss_percent=1.0)],
    ids=lambda link: link.describe().replace(" ", "-").replace(",", ""),
)
def test_a_reader_that_stops_is_paused_parked_and_released_live_readers_paced_whole(
    agent: Agent, engine_lab: Any, link: Link
) -> None:
    lab: EngineLab = engine_lab(link)  # MTU 1500, MSS 1448, the engine's defaults
    start_agent(agent, lab)
    expected = {tokens: reference_stream(lab, tokens) for tokens in (LONG_TOKENS, LIVE_TOKENS)}
    for tokens in expected:
        assert not entries_for(agent, f"cmpl-reference-{tokens}", "decision"), "it kept up"
    returns = lab.request(
        Reader("returns", "default", 1 << 24, pause_after=1.0, pause_seconds=600),
        "returns",
        LONG_TOKENS,
    )
    live = [
        lab.request(Reader(name, "default", rate), name, LIVE_TOKENS)
        for name, rate in (("reader-4k", 4096), ("reader-8k", 8192))
    ]

    # The reader that stopped: paused, then parked with its KV freed; nothing cut.
    wait_until(lambda: ("park", "parked") in actions_of(agent, "cmpl-returns"), timeout_seconds=60)
    assert actions_of(agent, "cmpl-returns")[:2] == [("pause", "paused"), ("park", "parked")]
    pause, park = entries_for(agent, "cmpl-returns", "decision")[:2]
    assert (pause["verdict"], pause["reason"]) == ("act", "reader_behind"), pause
    assert (park["verdict"], park["reason"]) == ("act", "reader_still_behind"), park
    assert pause["evidence"]["backlog"]["seconds"] >= PAUSE_SECONDS
    parked = next(e for e in entries_for(agent, "cmpl-returns", "outcome") if e["action"] == "park")
    assert parked["result"]["freed_blocks"] > 0
    report = lab.engine_request("cmpl-returns")
    assert report["state"] == "parked" and report["kv_blocks"] == 0, report
    read_tokens = parse_stream(returns.received[: returns.paused_at_bytes]).tokens
    pace = read_tokens / 1.0  # tokens per second while it read
    decoded_for_nobody = report["tokens_generated"] - read_tokens
    print(
        f"{link.describe()}: read {read_tokens} tokens, then the engine decoded "
        f"{decoded_for_nobody} more ({decoded_for_nobody / pace:.1f} s of the stream) before "
        f"the pause held"
    )
    assert decoded_for_nobody / pace < DECODED_FOR_NOBODY_SECONDS
    row = next(r for r in agent.streams() if r["request_id"] == "cmpl-returns")
    assert row["parked"] and row["kv_blocks"] == 0 and row["backlog"]["bytes"] > 0, row
    assert returns.reset_ns == 0, "holding cuts no one"

    # It reads again: released, its KV back, and it gets exactly the unpaused stream.
    returns.stop_pause()
    wait_until(lambda: returns.ended_ns != 0, timeout_seconds=90)
    assert parse_stream(returns.received) == expected[LONG_TOKENS]
    assert ("release", "released") in actions_of(agent, "cmpl-returns")

    # Live readers slower than their stream are paced, never cut, and get every byte.
    wait_until(lambda: all(r.ended_ns for r in live), timeout_seconds=300)
    for reader in live:
        assert reader.reset_ns == 0, f"{reader.name} was cut"
        assert parse_stream(reader.received) == expected[LIVE_TOKENS], reader.name
        cuts = [
            e
            for e in entries_for(agent, f"cmpl-{reader.name}", "decision")
            if e["verdict"] == "act" and e["reason"] == "stalled"
        ]
        assert not cuts, f"{reader.name} would have been cut: {cuts}"


def test_an_engine_that_cannot_pause_or_park_is_only_cut(agent: Agent, engine_lab: Any) -> None:
    lab: EngineLab = engine_lab(Link(), "--no-park", "--no-pause")
    start_agent(agent, lab)
    lab.request(Reader("stopped", "default", 0, read_seconds=0), "stopped", 1900)
    wait_until(
        lambda: any(
            r["request_id"] == "cmpl-stopped" and r["stalled_seconds"] > PARK_SECONDS + 2
            for r in agent.streams()
        ),
        timeout_seconds=60,
    )
    row = next(r for r in agent.streams() if r["request_id"] == "cmpl-stopped")
    assert not (row["parked"] or row["paused"]) and row["kv_blocks"] > 0, row
    assert not [a for a in agent.audit_entries("decision") if a["reason"] != "stalled"]
    engines = httpx.get(f"{agent.agent_url}/healthz", timeout=5).json()["engines"]
    assert engines and all(not engine["features"] for engine in engines), engines
