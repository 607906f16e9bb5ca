"""Behind a real nginx and a real haproxy (Debian's, configured for SSE): a client that stops
reading at the proxy is a stall of the engine request its proxy feeds it from. The agent
watches the proxy's port and the engine's; the proxy sends X-Forwarded-For.

- small buffers: the stalled client's request is cancelled through the engine hook (its KV
  freed and counted), then its socket at the proxy is reset; a healthy client and one that
  reads slowly but above the reader guarantee, through the same proxy, finish untouched;
- default buffers: the proxy and the kernel absorb megabytes, so the engine finishes the
  request on its own while its client is stalled: that client is left alone, even with
  reset configured ("request_ended");
- upstream keep-alive: a client socket stalled on an earlier request does not inherit the
  next request its upstream connection carries, and is left alone ("request_ended");
- a proxy that closed its client sockets while its kernel drains them to slow readers: they
  are never judged (state `closed`), and get every byte;
- haproxy with bounded buffers: a client that reads slowly but above the reader guarantee
  is never cut, although the engine's own socket stalls (it sees only haproxy's few KB of
  upstream buffer): that socket defers to the client socket at the proxy ("relayed").

A client here asks the proxy to close its connection after the response, unless the test
says it keeps it alive: a proxy closes such a client socket once the response is in the
kernel's hands, and a socket its process closed is never acted on, so a test about the
decision on a stalled client that outlived its request keeps the connection alive.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kvwatch.lab import waiting
from kvwatch.lab.harness.cut_stack import CutStack
from kvwatch.lab.harness.stack import kvwatch_command
from kvwatch.lab.proxies import PROXIES, Proxy, client, start_proxy, through
from kvwatch.lab.readers import Reader
from kvwatch.tools.client import get_json
from tests.metrics_text import metric_value

pytestmark = [pytest.mark.bpf, pytest.mark.engine, pytest.mark.slow]
T = TypeVar("T")

GUARANTEE = 4096  # the agent's default min_reader_bytes_per_second
# Default buffers: the client's ~128 KB buffer makes the guarantee's wait (B / rate) 32 s at
# the default rate; at this one it is ~16 s, still long after the engine finished the request
# (~3 s idle, ~11 s on a machine loaded by the parallel suite), which is what the test is about.
DEFAULT_BUFFERS_GUARANTEE = 8192
LONG_TOKENS = 1400  # ~250 KB, ~3 s at the reference engine's ~500 tokens/s (context: 2048)
SHORT_TOKENS = 500  # ~90 KB, done in ~1 s
# ~250 KB: done in ~3 s idle, ~11 s loaded (the agent paces nothing in that test); whatever
# the engine's pace, the proxy closes a client socket with tens of KB still queued for a
# 6 KB/s reader behind a 64 KB buffer.
DRAINED_TOKENS = 1400
DRAINED_SECONDS = 120.0  # a 5 KB/s reader takes ~50 s
# A bound on waits for what follows the engine's answer: ~3 s idle, several times that on a
# machine the parallel suite loads (its engine decodes 3-4 times slower).
SETTLE_SECONDS = 30.0
# The first client's guarantee in the keep-alive test: its 4 KB buffer / this = 8 s after the
# stall, long after its short request ended, whatever the load.
KEEP_ALIVE_GUARANTEE = 512
# A client socket joins its request after 3 feeds from the upstream since the request began.
JOIN_SECONDS = 20.0
# Issue 21: haproxy's upstream receive buffer bounded to 4 KB (8 KB with the kernel's
# doubling), its client send buffer to 16 KB, and a client with a 64 KB receive buffer that
# reads 5.5 KB/s: the engine's socket stalls for tens of seconds at a time while the client
# drains its own buffer, and is judged stalled after ~3.2 s of it.
BOUNDED_UPSTREAM_RCVBUF = 4096
SLOW_READER = 5632


@pytest.fixture(params=PROXIES)
def proxied(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[CutStack, Proxy]]:
    """The engine behind one proxy; tests marked `small_buffers` get the proxy's small ones
    (for haproxy its upstream receive buffer too: else its kernel buffer, autotuned to
    megabytes, absorbs the whole response, and the request ends on its own before its
    client's stall is proven)."""
    stack = CutStack(tmp_path)
    proxy = None
    small = request.node.get_closest_marker("small_buffers") is not None
    bounded = BOUNDED_UPSTREAM_RCVBUF if small and request.param == "haproxy" else 0
    try:
        stack.start_engine()
        proxy = start_proxy(request.param, tmp_path, stack.engine_port, small, bounded)
        yield stack, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        stack.close()


def start_agent(stack: CutStack, proxy: Proxy, *args: str) -> None:
    stack.start_agent("--mode", "enforce", "--port", str(stack.engine_port), *args, port=proxy.port)
    stack.wait_engine_connected()


def wait_for(check: Callable[[], T | None], seconds: float, what: waiting.Description) -> T:
    """kvwatch.lab.waiting.wait_for, looking every 100 ms: most looks ask the agent's API or
    read its audit log."""
    return waiting.wait_for(check, seconds, what, poll_seconds=0.1)


def stream_row(stack: CutStack, local: str) -> dict[str, Any] | None:
    """The agent's row for the proxy's client socket whose peer is `local` (the client)."""
    rows: list[dict[str, Any]] = get_json(stack.agent_url, "/api/v1/streams")
    return next((row for row in rows if row["remote"] == local), None)


def decisions_said(stack: CutStack) -> str:
    """Each decision so far, with its relay link's account, for a failure message."""
    said = []
    for decision in stack.audit_entries("decision"):
        relay = decision["evidence"]["relay"] or {}
        said.append(
            f"{decision['remote']} {decision['verdict']} {decision['reason']} "
            f"({relay.get('detail')})"
        )
    return "; ".join(said)


def engine_state(stack: CutStack, request_id: str) -> str | None:
    """The request's state as the engine tells it (GET /v1/requests/ID), None before it."""
    response = httpx.get(f"{stack.engine_url}/v1/requests/{request_id}", timeout=5.0)
    return str(response.json()["state"]) if response.status_code == 200 else None


def finished_cleanly(reader: Reader) -> bool:
    return bool(reader.ended_ns) and not reader.reset_ns and b"[DONE]" in reader.received


@pytest.mark.small_buffers
def test_a_stalled_client_is_cancelled_reset_and_counted_and_live_ones_are_not_touched(
    proxied: tuple[CutStack, Proxy],
) -> None:
    stack, proxy = proxied
    start_agent(stack, proxy)
    readers = [
        through(proxy, client("held", "4k", GUARANTEE, read_seconds=0), LONG_TOKENS),
        through(proxy, client("healthy", "default", 1 << 24), LONG_TOKENS),
        through(proxy, client("slow", "4k", 2 * GUARANTEE), 300),
    ]
    held, healthy, slow = readers
    try:
        cancel = wait_for(
            lambda: next(
                (o for o in stack.audit_entries("outcome") if o["action"] == "reset"), None
            ),
            SETTLE_SECONDS,
            lambda: f"reset of the stalled client; decisions: {decisions_said(stack)}",
        )
        wait_for(lambda: healthy.ended_ns and slow.ended_ns, 60, "the live clients' ends")
        wait_for(lambda: held.reset_ns or held.ended_ns, 5, "the stalled client's end")
    finally:
        for reader in readers:
            reader.close()
    decisions = stack.audit_entries("decision")
    acted = [d for d in decisions if d["verdict"] == "act"]
    assert [d["request_id"] for d in acted] == ["cmpl-held"], decisions
    relay = acted[0]["evidence"]["relay"]
    assert relay["status"] == "joined", relay
    assert (
        relay["chain"]
        == f"{held.local} ⇄ {relay['comm']}[{relay['pid']}] ⇄ engine request cmpl-held"
    )
    assert relay["comm"] == proxy.name, relay
    outcomes = {o["action"]: o["result"] for o in stack.audit_entries("outcome")}
    assert outcomes["cancel"]["status"] == "cancelled" and outcomes["cancel"]["freed_bytes"] > 0
    assert cancel["result"]["status"] == "reset"
    assert held.reset_ns or held.ended_ns, "the stalled client is not left hanging"
    assert finished_cleanly(healthy), healthy
    assert finished_cleanly(slow), slow
    engine_metrics = httpx.get(f"{stack.engine_url}/metrics").text
    assert metric_value(engine_metrics, "kvwatch_engine:kv_cache_blocks_used") == 0
    agent_metrics = httpx.get(f"{stack.agent_url}/metrics").text
    assert (
        metric_value(agent_metrics, "kvwatch_actions_reclaimed_kv_bytes_total")
        == outcomes["cancel"]["freed_bytes"]
    )
    explained = subprocess.run(
        [*kvwatch_command(), "explain", "cmpl-held", "--url", stack.agent_url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert relay["chain"] in explained and "cancelled, freed" in explained, explained


def test_default_buffers_a_request_that_finished_into_them_is_left_alone(
    proxied: tuple[CutStack, Proxy],
) -> None:
    """The proxy's and the kernel's default buffers absorb the whole response: the engine
    finishes and frees the KV on its own. Even with reset configured, the stalled client is
    not cut: its request has ended, and the decision says so."""
    stack, proxy = proxied
    start_agent(
        stack, proxy, "--action", "reset", "--min-reader-rate", str(DEFAULT_BUFFERS_GUARANTEE)
    )
    held = through(
        proxy, client("held", "default", 0, read_seconds=0), LONG_TOKENS, keep_alive=True
    )
    try:
        decision = wait_for(
            lambda: next(iter(stack.audit_entries("decision")), None),
            3 * SETTLE_SECONDS,
            "a decision on the stalled client",
        )
        row = stream_row(stack, held.local)
        time.sleep(1)  # deliberate: room for an action after the decision, were there one
    finally:
        held.close()
    assert (decision["verdict"], decision["reason"]) == ("skip", "request_ended"), decision
    assert decision["evidence"]["remote"] == held.local
    assert row is not None and row["relay"]["status"] == "request_ended", row
    assert not stack.audit_entries("outcome")
    assert not held.reset_ns
    engine_metrics = httpx.get(f"{stack.engine_url}/metrics").text
    assert metric_value(engine_metrics, "kvwatch_engine:kv_cache_blocks_used") == 0


def test_a_client_stalled_on_an_earlier_request_does_not_inherit_the_next(
    proxied: tuple[CutStack, Proxy],
) -> None:
    """One request finishes into a stalled client's buffers (a kept-alive client connection,
    so the proxy keeps its socket); the upstream connection it came on is kept alive and may
    carry the next client's request (haproxy's http-reuse; nginx's keepalive pool, per
    worker). The first client's socket is judged stalled ~3 s later: its request has ended
    ("request_ended", the upstream now carrying the second request or none), and it is not
    reset, although the second client's socket was fed by the same upstream since (issue 21:
    it was `ambiguous`, and reset)."""
    stack, proxy = proxied
    start_agent(
        stack,
        proxy,
        "--action",
        "cancel",
        "--action",
        "reset",
        "--min-reader-rate",
        str(KEEP_ALIVE_GUARANTEE),
    )
    first = through(proxy, client("first", "4k", 0, read_seconds=0), SHORT_TOKENS, keep_alive=True)
    second: Reader | None = None
    try:
        wait_for(lambda: first.bytes_read, 5, "the first client's first bytes")
        wait_for(
            lambda: engine_state(stack, "cmpl-first") == "finished",
            SETTLE_SECONDS,
            "the first request's end, into the buffers",
        )
        # Sent at the end (or 0.5 s after), the second client's socket was never joined (12 s)
        # behind haproxy in 5 runs of 5 and behind nginx in 1 of 5; 1 s after, it was: the
        # join seems to need a gap.
        time.sleep(1)  # deliberate: the gap
        second = through(proxy, client("second", "4k", 2 * GUARANTEE), LONG_TOKENS)
        # Joined while its request runs (it may end, into the proxy's buffers, before the
        # first client's decision, ~8 s after its stall at this guarantee).
        second_row = wait_for(
            lambda: (row := stream_row(stack, second.local)) and row["request_id"] and row,
            JOIN_SECONDS,
            lambda: f"the second client's socket joined: {stream_row(stack, second.local)}",
        )
        decision = wait_for(
            lambda: next(
                (d for d in stack.audit_entries("decision") if d["remote"] == first.local), None
            ),
            SETTLE_SECONDS,
            "a decision on the first client",
        )
        time.sleep(1)  # deliberate: an action would follow the decision within milliseconds
    finally:
        first.close()
        if second is not None:
            second.close()
    assert (decision["verdict"], decision["reason"]) == ("skip", "request_ended"), decision
    assert decision["evidence"]["relay"]["status"] == "request_ended", decision
    assert not [o for o in stack.audit_entries("outcome") if o["remote"] == first.local]
    assert not first.reset_ns
    assert second_row["request_id"] == "cmpl-second", second_row
    assert second_row["relay"]["status"] == "joined", second_row


@pytest.fixture
def bounded_haproxy(tmp_path: Path) -> Iterator[tuple[CutStack, Proxy]]:
    """The engine behind haproxy with bounded buffers: its upstream receive buffer and its
    client send buffer."""
    stack = CutStack(tmp_path)
    proxy = None
    try:
        stack.start_engine()
        proxy = start_proxy(
            "haproxy", tmp_path, stack.engine_port, True, upstream_rcvbuf=BOUNDED_UPSTREAM_RCVBUF
        )
        yield stack, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        stack.close()


def test_a_slow_live_reader_behind_haproxy_is_never_cut_for_the_engines_stall(
    bounded_haproxy: tuple[CutStack, Proxy],
) -> None:
    """Issue 21, part 3: the end client reads 5.5 KB/s, above the reader guarantee, through a
    64 KB buffer. The engine's own socket sees only haproxy's few KB of upstream buffer and is
    judged stalled while the client drains its own buffer; judged alone, its request was
    cancelled. Its peer is haproxy's upstream, which feeds the client's socket at the proxy:
    that socket decides, and the engine's socket is `relayed`. The client gets every byte."""
    stack, proxy = bounded_haproxy
    start_agent(stack, proxy, "--action", "cancel", "--action", "reset")
    reader = through(proxy, client("slow", "64k", SLOW_READER), LONG_TOKENS)
    try:
        wait_for(lambda: reader.ended_ns or reader.reset_ns, 90, "the slow client's end")
    finally:
        reader.close()
    engine_side = f"127.0.0.1:{stack.engine_port}"
    decisions = stack.audit_entries("decision")
    assert [d for d in decisions if d["verdict"] != "skip"] == []
    # Whether the engine's socket looks stalled depends on how haproxy's bursts fall (the
    # reader is above the guarantee): idle it did within seconds, loaded sometimes never. When
    # it does, it defers to the client's socket at the proxy.
    on_engine = [d for d in decisions if d["local"] == engine_side]
    for decision in on_engine:
        evidence = decision["evidence"]
        assert decision["reason"] == "relayed", decision
        assert decision["request_id"] == "cmpl-slow" and evidence["state"] == "stalled", evidence
        relay = evidence["relay"]
        assert relay["status"] == "relayed" and relay["comm"] == "haproxy", relay
        chain = f"{reader.local} ⇄ haproxy[{relay['pid']}] ⇄ engine request cmpl-slow"
        assert relay["chain"] == chain, relay
    print(f"the engine's socket was judged {len(on_engine)} times, each deferred")
    assert stack.audit_entries("outcome") == []
    assert finished_cleanly(reader), reader


def test_slow_readers_a_proxy_closed_on_while_its_kernel_drains_are_never_cut(
    proxied: tuple[CutStack, Proxy],
) -> None:
    """Issue 21's false "silence": the engine finishes within seconds, the proxy closes its
    client sockets with tens of KB still queued, and its kernel sends the rest at the
    readers' pace — ACKs the ACK path no longer sees (FIN_WAIT1). Readers at 6 KB/s behind a
    64 KB buffer and 5 KB/s behind the default one get every byte; the first one's socket
    reads `closed` while it drains, and nothing is decided on either, with cancel and reset
    configured. Pause and park are off: pacing the engine to these readers (the default)
    leaves the proxy almost nothing to drain when it closes, and the drain is the subject."""
    stack, proxy = proxied
    start_agent(
        stack, proxy, "--action", "cancel", "--action", "reset", "--pause", "off", "--park", "off"
    )
    readers = [
        through(proxy, client("slow-64k", "64k", 6 * 1024), DRAINED_TOKENS),
        through(proxy, client("slow-default", "default", 5 * 1024), DRAINED_TOKENS),
    ]
    try:
        small = readers[0]  # the default buffer may take in all that is left
        wait_for(
            lambda: (row := stream_row(stack, small.local)) and row["state"] == "closed",
            DRAINED_SECONDS,
            f"{small.name}'s socket closed by {proxy.name} while it drains",
        )
        wait_for(
            lambda: all(r.ended_ns or r.reset_ns for r in readers),
            DRAINED_SECONDS,
            "the readers' ends",
        )
    finally:
        for reader in readers:
            reader.close()
    for reader in readers:
        assert finished_cleanly(reader), reader
    clients = {reader.local for reader in readers}
    assert not [d for d in stack.audit_entries("decision") if d["remote"] in clients]


def test_behind_haproxy_a_stopped_reader_is_parked_and_a_live_reader_resumes(
    bounded_haproxy: tuple[CutStack, Proxy],
) -> None:
    """Issues 23 and 37: behind a proxy the engine cannot see its client, but the agent can:
    the client's socket at the proxy (`joined` to the engine's request) shows the reader
    behind, and once the proxy's buffers are full the engine's own socket (`relayed` to that
    client socket) backs up too. Whichever shows it first, the request is parked within
    park_seconds, and the engine resumes when the reader reads again. A client that stopped
    reading is parked; one that reads 5.5 KB/s, above the guarantee, may be parked and
    resumed, gets every byte, and is never cut."""
    stack, proxy = bounded_haproxy
    start_agent(stack, proxy, "--park", "on", "--park-seconds", "2")
    held = through(proxy, client("held", "64k", GUARANTEE, read_seconds=0), LONG_TOKENS)
    slow = through(proxy, client("slow", "64k", SLOW_READER), LONG_TOKENS)
    engine_side = f"127.0.0.1:{stack.engine_port}"
    try:
        parked = wait_for(
            lambda: next(
                (o for o in stack.audit_entries("outcome")
                 if o["request_id"] == "cmpl-held" and o["result"]["status"] == "parked"),
                None,
            ),
            30,
            lambda: f"the held request parked; decisions: {decisions_said(stack)}",
        )  # fmt: skip
        wait_for(lambda: slow.ended_ns or slow.reset_ns, 90, "the slow client's end")
    finally:
        for reader in (held, slow):
            reader.close()
    # The engine's own socket, relayed to the client's at the proxy, or the client's socket
    # at the proxy, joined to the engine's request.
    status_by_socket = {engine_side: "relayed", f"127.0.0.1:{proxy.port}": "joined"}
    assert parked["local"] in status_by_socket, parked
    decision = next(
        d for d in stack.audit_entries("decision") if d["decision_id"] == parked["decision_id"]
    )
    relay = decision["evidence"]["relay"]
    assert relay["status"] == status_by_socket[parked["local"]], relay
    assert decision["evidence"]["stalled_seconds"] < 3.0
    cuts = [
        o for o in stack.audit_entries("outcome")
        if o["request_id"] == "cmpl-slow" and o["action"] in ("cancel", "reset")
    ]  # fmt: skip
    assert cuts == [], cuts
    assert finished_cleanly(slow), slow
