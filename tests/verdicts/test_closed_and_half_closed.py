"""Sockets in the TCP states the ACK path does not follow (docs/collector.md, "States other
than ESTABLISHED"): a server that wrote its answer and closed while the kernel still drains
it (FIN_WAIT1, an orphan: no request, no KV, never acted on), and a client that half-closed
after its request and reads on (the server's socket in CLOSE_WAIT, whose ACKs tcp_probe never
sees: the agent reads it up to the kernel's own view, so its reader is not even a
candidate, and a dead one is still cut). Real BPF, an agent in enforce mode with the reset
action, clients in a network namespace across a veth link (MSS 1448)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvwatch.config.schema import DEFAULT_MIN_READER_BYTES_PER_SECOND
from kvwatch.lab.labs import Agent, Lab
from kvwatch.lab.netlab import Link
from kvwatch.lab.readers import Reader
from kvwatch.lab.token_server import EVENT
from kvwatch.lab.waiting import wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
# Across the veth link as it is, and with 50 ms of RTT and 1% loss each way.
LINKS = pytest.mark.parametrize("link", [Link(0, 0.0), Link(25, 1.0)], ids=Link.describe)

GUARANTEE = DEFAULT_MIN_READER_BYTES_PER_SECOND
BURST_BYTES = 150_000
# The server closes this long after queueing its answer: the readers' windows shut while the
# socket is still ESTABLISHED, so the record holds a zero window when the ACK path loses it.
LINGER_SECONDS = 4.0
BURST_READ_SECONDS = BURST_BYTES / (2 * GUARANTEE) + 10
HALF_CLOSED_WATCH_SECONDS = 25.0


@LINKS
def test_a_server_that_closed_while_the_kernel_drains_is_never_cut(
    labs: Callable[[Link], Lab], agent: Agent, link: Link
) -> None:
    agent.start()
    lab = labs(link)
    request = f"burst {BURST_BYTES} {LINGER_SECONDS}\n".encode()
    live = [
        lab.connect(Reader(f"closed-live-{buffer}", buffer, 2 * GUARANTEE, eof_ends=True), request)
        for buffer in ("64k", "default")
    ]
    dead = lab.connect(Reader("closed-dead-64k", "64k", GUARANTEE, read_seconds=0), request)
    wait_until(
        lambda: all(reader.ended_ns or reader.reset_ns for reader in live),
        BURST_READ_SECONDS,
        lambda: (
            "every live reader's end: "
            + ", ".join(f"{r.name} read {r.bytes_read} of {BURST_BYTES} bytes" for r in live)
        ),
        poll_seconds=0.2,
    )

    sent = (EVENT * (BURST_BYTES // len(EVENT) + 1))[:BURST_BYTES]
    for reader in live:
        assert not reader.reset_ns, f"{reader.name} was cut"
        assert reader.ended_ns, f"{reader.name} read {reader.bytes_read} of {BURST_BYTES} bytes"
        assert bytes(reader.received) == sent, f"{reader.name} got other bytes"
    assert not dead.reset_ns, "a client of a closed server was cut: it pins no KV"
    clients = {reader.local for reader in (*live, dead)}
    assert not [act for act in agent.acts() if act["remote"] in clients]
    (row,) = [row for row in agent.sockets_json() if row["remote"] == dead.local]
    assert (row["state"], row["orphaned"], row["pid"]) == ("closed", True, 0), row
    (stream,) = [row for row in agent.streams() if row["remote"] == dead.local]
    assert (stream["request_id"], stream["kv_bytes"]) == (None, None), stream


@LINKS
def test_a_half_closed_client_that_reads_on_is_never_cut_and_a_dead_one_is(
    labs: Callable[[Link], Lab], agent: Agent, link: Link
) -> None:
    agent.start()
    lab = labs(link)
    live = lab.connect(Reader("half-closed-live-64k", "64k", 3 * GUARANTEE // 2, half_close=True))
    dead = lab.connect(
        Reader("half-closed-dead-4k", "4k", 4 * GUARANTEE, read_seconds=0, half_close=True)
    )
    time.sleep(HALF_CLOSED_WATCH_SECONDS)  # deliberate: the live reader must last it uncut

    assert not live.reset_ns, f"the live half-closed reader was cut after {live.bytes_read} bytes"
    assert live.bytes_read >= GUARANTEE * (HALF_CLOSED_WATCH_SECONDS - 5)
    assert dead.reset_ns, "the dead half-closed reader was never cut"
    decisions = {(entry["remote"], entry["reason"]) for entry in agent.audit_entries("decision")}
    assert (dead.local, "stalled") in decisions
    # The agent reads the half-closed socket's record up to the kernel's view at each scan:
    # the live reader is never even a candidate.
    assert not [e for e in agent.audit_entries("decision") if e["remote"] == live.local]
    (act,) = [act for act in agent.acts() if act["remote"] == dead.local]
    assert act["evidence"]["kernel"]["tcp_state"] == "CLOSE_WAIT"
