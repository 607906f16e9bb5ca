"""Only a connection a process opened itself can feed one it accepted (issue 21, part 4): a
plain server whose thread reads client A and writes client B looks like a relay to the
kernel's pairing, but A's socket at the server was accepted (its local port is the server's
listening port), so B's socket has no relay link: no chain, no feeder shown, nothing to
reset through it. Real BPF (the test's own collector sees the kernel pair them), a real
agent, the server as its own process."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwatch.collect.bpf.collector import BpfCollector
from kvwatch.collect.bpf.loader import CollectorSettings
from kvwatch.collect.diag.snapshot import DiagClient
from kvwatch.lab.harness.cut_stack import CutStack
from kvwatch.lab.harness.stack import free_port
from kvwatch.lab.readers import Reader
from kvwatch.sockets import Endpoint
from kvwatch.tools.client import get_json
from tests.proxy.test_behind_a_proxy import wait_for

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

CHUNK = b"x" * 200
SEND_SECONDS = 3.0


@pytest.fixture
def crossfeed(tmp_path: Path) -> Iterator[int]:
    """The crossfeed server on a free port; yields the port."""
    port = free_port()
    log = tmp_path / "crossfeed.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.proxy.crossfeed_server", str(port)], stdout=out
        )
    try:
        wait_for(lambda: "listening" in log.read_text(), 10, "the crossfeed server")
        yield port
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def socket_pair(port: int) -> Iterator[tuple[socket.socket, Reader]]:
    """Client A (the server reads it; connected first, so accepted first) and client B, a
    reader (the server writes it)."""
    source = socket.create_connection(("127.0.0.1", port))
    sink = Reader("sink", "default", 1 << 24)
    try:
        # A is accepted first: its connection is in the server's accept queue before B connects.
        server_end = Endpoint("127.0.0.1", port), Endpoint(*source.getsockname())
        with DiagClient() as diag:
            wait_for(lambda: diag.find(*server_end), 5, "client A's connection at the server")
        sink.connect(socket.socket(), "127.0.0.1", port, b"")
        yield source, sink
    finally:
        sink.close()
        source.close()


def paired_in_kernel(collector: BpfCollector, port: int, client: str) -> bool:
    """The kernel's pairing named a feeder for the server's socket to `client`."""
    return any(
        s.local.port == port and str(s.remote) == client and s.feeder is not None
        for s in collector.samples()
    )


def row_of(stack: CutStack, client: str) -> dict[str, Any] | None:
    """The agent's row for the server's socket to `client`."""
    rows: list[dict[str, Any]] = get_json(stack.agent_url, "/api/v1/streams")
    return next((r for r in rows if r["remote"] == client), None)


def test_a_server_thread_that_reads_one_client_and_writes_another_is_no_relay(
    tmp_path: Path, crossfeed: int
) -> None:
    stack = CutStack(tmp_path)
    kernel = BpfCollector(CollectorSettings())
    try:
        stack.start_agent(port=crossfeed)
        with socket_pair(crossfeed) as (source, sink):
            deadline = time.monotonic() + SEND_SECONDS
            while time.monotonic() < deadline:
                source.sendall(CHUNK)
                time.sleep(0.02)  # deliberate: A sends a steady trickle for SEND_SECONDS
            wait_for(
                lambda: paired_in_kernel(kernel, crossfeed, sink.local), 10, "the kernel's pairing"
            )
            row = wait_for(lambda: row_of(stack, sink.local), 10, "the paired socket's row")
            rows: list[dict[str, Any]] = get_json(stack.agent_url, "/api/v1/streams")
    finally:
        kernel.close()
        stack.close()
    assert sink.bytes_read > 0
    assert row["feeder"] is None and row["relay"] is None and row["request_id"] is None, row
    assert [r for r in rows if r["relay"] is not None or r["feeder"] is not None] == [], rows
