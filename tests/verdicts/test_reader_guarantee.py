"""The guarantee users read in docs/collector.md: a client that drains at least
`min_reader_bytes_per_second` is never cut, whatever its receive buffer, RTT or loss; a client
that stopped reading is cut once the kernel has shown it — within its required time plus
0.5 s, with the evidence in the audit line. Real BPF, an agent in enforce mode with the
reset action, a token server and clients in network namespaces joined by veth with netem."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvwatch.config.schema import DEFAULT_MIN_READER_BYTES_PER_SECOND
from kvwatch.lab.labs import SERVER_BYTES_PER_SECOND, Agent, Lab
from kvwatch.lab.netlab import Link
from kvwatch.lab.readers import Buffer, Reader

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

GUARANTEE = DEFAULT_MIN_READER_BYTES_PER_SECOND
LINKS = (Link(0, 0.0), Link(25, 1.0), Link(50, 1.0))
BUFFERS: tuple[Buffer, ...] = ("4k", "64k", "default", "autotuned")
WATCH_SECONDS = 75.0
PROOF_LOST = "proof lost on a lossy link"
# How long a dead reader's buffer can take to fill once it stops: twice its 64 KB window
# (what a receiver holds unread) at the server's rate, with room for the RTT and slow start.
FILL_SECONDS = 2 * 65536 / SERVER_BYTES_PER_SECOND + 2


def readers_for(lab: Lab) -> None:
    for buffer in BUFFERS:
        for rate in (GUARANTEE, 2 * GUARANTEE):
            lab.connect(Reader(f"live-{buffer}-{rate}", buffer, rate))
    dead: tuple[tuple[str, Buffer, float], ...] = (
        ("never-4k", "4k", 0.0),
        ("never-64k", "64k", 0.0),
        ("never-default", "default", 0.0),
        ("stops-4k", "4k", 4.0),
        ("stops-64k", "64k", 4.0),
        ("stops-mid-event-4k", "4k", 2.5),
    )
    for name, buffer, seconds in dead:
        lab.connect(Reader(name, buffer, 4 * GUARANTEE, read_seconds=seconds))


def test_live_readers_are_never_cut_and_dead_ones_are(
    labs: Callable[[Link], Lab], agent: Agent
) -> None:
    agent.start()
    made = [labs(link) for link in LINKS]
    for lab in made:
        readers_for(lab)
    time.sleep(WATCH_SECONDS)  # deliberate: a soak the live readers must last uncut

    acts = {entry["remote"]: entry for entry in agent.acts()}
    reset = {
        e["remote"] for e in agent.audit_entries("outcome") if e["result"]["status"] == "reset"
    }
    rows = {row["remote"]: row for row in agent.streams()}
    problems = [
        problem
        for lab in made
        for reader in lab.readers
        for problem in judged(
            reader,
            acts.get(reader.local),
            rows.get(reader.local),
            lab.net.path,
            reader.local in reset,
        )
    ]
    late = [p for p in problems if p.startswith(PROOF_LOST)]
    dead = sum(not reader.live for lab in made for reader in lab.readers)
    assert not [p for p in problems if p not in late], "\n".join(problems)
    assert len(late) <= dead // 6, "\n".join(late)


def judged(
    reader: Reader,
    entry: dict[str, Any] | None,
    row: dict[str, Any] | None,
    link: Link,
    was_reset: bool,
) -> list[str]:
    """What is wrong with how the agent treated `reader`, one line per problem. A dead
    reader whose stall is not due yet is not one: with the kernel's default buffer a
    reader that never reads keeps absorbing (its receive buffer grows towards tcp_rmem[2]
    while its window stays open), so its stall may begin minutes later. Over a lossy link a
    lost probe or answer delays the proof by a whole probe interval: such a reader is
    reported as PROOF_LOST, and a few of those are allowed. Whether a reset
    took is read from the agent's outcome line: over a lossy link the client may never get
    the RST, as with any reset."""
    where = f"{reader.name} over {link.describe()}"
    if reader.live:
        problems = [f"{where} was cut: {entry['evidence']}"] if entry else []
        if reader.reset_ns:
            problems.append(f"{where} was reset")
        if reader.bytes_read < 0.9 * reader.rate * (WATCH_SECONDS - 5):
            problems.append(f"{where} read only {reader.bytes_read} B")
        return problems
    if entry is None:
        if (
            row is not None
            and row["stall_required_seconds"] is not None
            and row["stalled_seconds"] > row["stall_required_seconds"] + 0.5
        ):
            unproven = f"{where} was due and never acted on: {row['stall_evidence']}"
            lost = link.loss_percent and not row["stall_evidence"]["proof"]
            return [f"{PROOF_LOST}: {unproven}" if lost else unproven]
        print(f"{where}: not due yet ({row and row['stall_evidence']})")
        return []
    evidence = entry["evidence"]
    required, stalled = evidence["stall_required_seconds"], evidence["stalled_seconds"]
    since_stop = (entry["monotonic_ns"] - reader.stopped_ns) / 1e9
    summary = (
        f"{where}: stalled {stalled} s, required {required} s, {since_stop:.2f} s after it "
        f"stopped reading; {evidence['stall_evidence']}"
    )
    print(summary)
    problems = []
    if not evidence["stall_evidence"]["proof"]:
        problems.append(f"unproven: {summary}")
    if stalled > required + 0.5 or since_stop > required + FILL_SECONDS + 0.5:
        problems.append(f"late: {summary}")
    if not was_reset:
        problems.append(f"acted on, but the reset failed: {summary}")
    return problems
