"""A socket table too small for the node is loud and still safe: the agent says so (log,
/healthz, metric, with the size that would fit) and a sock_diag sweep still finds the stall
the table has no room for. Only the LRU hash has a size (socket-local storage, where every
attach point is BTF-typed, grows with the sockets): the send mode is forced to the raw tracepoint,
which keeps records in the hash, as on kernels without BTF-typed programs."""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from kvwatch.lab.labs import SERVER_PORT, Agent, Lab
from kvwatch.lab.netlab import Link
from kvwatch.lab.readers import Reader

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

TABLE_SIZE = 64
BUSY_STREAMS = 300
BUSY_BYTES_PER_SECOND = 400  # two events a second each: the table thrashes


def drain_all(sockets: list[socket.socket], stop: threading.Event) -> None:
    """One thread reads every busy stream as fast as it comes."""
    while not stop.is_set():
        readable, _, _ = select.select(sockets, [], [], 0.1)
        for sock in readable:
            try:
                sock.recv(65536)
            except OSError:
                sockets.remove(sock)


def test_a_stall_is_found_when_the_table_has_no_room(
    labs: Callable[[Link], Lab], agent: Agent
) -> None:
    lab = labs(Link())
    agent.start("--max-sockets", str(TABLE_SIZE), "--send-mode", "raw_tp")
    busy = []
    for _ in range(BUSY_STREAMS):
        sock = lab.net.client_socket()
        sock.connect((lab.net.server_ip, SERVER_PORT))
        sock.sendall(f"stream {BUSY_BYTES_PER_SECOND}\n".encode())
        busy.append(sock)
    stop = threading.Event()
    reader = threading.Thread(target=drain_all, args=(list(busy), stop), daemon=True)
    reader.start()
    try:
        dead = lab.connect(Reader("never-4k", "4k", 0, read_seconds=0))
        deadline = time.monotonic() + 45
        while not [e for e in agent.acts() if e["remote"] == dead.local]:
            assert time.monotonic() < deadline, "the stall behind a full table was never acted on"
            time.sleep(0.2)
        health = httpx.get(f"{agent.agent_url}/healthz", timeout=5).json()
        table = health["socket_table"]
        assert table["full"] and table["max_sockets"] == TABLE_SIZE, table
        assert table["sockets_seen"] >= BUSY_STREAMS, table
        metrics = agent.metrics()
        needed = re.search(r"^kvwatch_bpf_socket_table_needed_sockets (\S+)$", metrics, re.M)
        assert needed is not None and float(needed.group(1)) >= BUSY_STREAMS
        doctor = agent.cli("doctor", "--url", agent.agent_url)
        assert re.search(r"socket table.*full", doctor), doctor
        log = agent.services[-1].log.read_text()
        assert "socket table is full" in log, log[-2000:]
        assert "--max-sockets" in log
    finally:
        stop.set()
        reader.join(timeout=2)
        for sock in busy:
            sock.close()
