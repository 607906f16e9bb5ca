"""Fixtures for the verdict tests: network labs with a token server in each, readers, and
agents (kvwatch.harness.stack) watching the server port. Everything is torn down after each test."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.harness import stack as processes
from kvwatch.tools.client import get_json

from .netlab import Link, NetLab
from .readers import Reader

SERVER_PORT = 18080
# A fast model's stream: 80 events of ~200 bytes a second; every reader below is slower.
SERVER_BYTES_PER_SECOND = 16384


@dataclass
class Lab:
    """A NetLab with a token server listening in its server namespace, and its readers."""

    net: NetLab
    server: subprocess.Popen[bytes]
    readers: list[Reader] = field(default_factory=list)

    def connect(self, reader: Reader, request: bytes = b"stream\n") -> Reader:
        reader.connect(self.net.client_socket(), self.net.server_ip, SERVER_PORT, request)
        self.readers.append(reader)
        return reader

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.server.terminate()
        self.server.wait(timeout=10)
        self.net.close()


@pytest.fixture
def labs(tmp_path: Path) -> Iterator[Callable[[Link], Lab]]:
    made: list[Lab] = []

    def make(link: Link) -> Lab:
        net = NetLab(link)
        try:
            log = tmp_path / f"server-{net.server_ns}.log"
            server = net.spawn_server(
                "tests.verdicts.token_server",
                net.server_ip,
                str(SERVER_PORT),
                str(SERVER_BYTES_PER_SECOND),
                log=log,
            )
            deadline = time.monotonic() + 10
            while "listening" not in log.read_text():
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        except BaseException:
            net.close()
            raise
        lab = Lab(net, server)
        made.append(lab)
        return lab

    yield make
    for lab in made:
        lab.close()


class Agent(processes.Stack):
    """`kvwatch run` in enforce mode with the reset action on the labs' server port."""

    def start(self, *args: str, env: dict[str, str] | None = None) -> processes.Service:
        return self.start_agent(
            "--mode", "enforce", "--action", "reset", "--grace-seconds", "0",
            "--max-cancels-per-minute", "1000", *args,
            port=SERVER_PORT, audit=f"audit-{len(self.services)}.jsonl", env=env,
        )  # fmt: skip

    def acts(self) -> list[dict[str, Any]]:
        return [e for e in self.audit_entries("decision") if e["verdict"] == "act"]

    @staticmethod
    def cli(*args: str) -> str:
        """A kvwatch command as a user runs it; its standard output."""
        done = subprocess.run(
            [*processes.kvwatch_command(), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return done.stdout

    def sockets_json(self, *args: str) -> list[dict[str, Any]]:
        """`kvwatch sockets --json` on the server port."""
        rows: list[dict[str, Any]] = json.loads(
            self.cli("sockets", "--port", str(SERVER_PORT), "--json", *args)
        )
        return rows

    def streams(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = get_json(self.agent_url, "/api/v1/streams")
        return rows

    def metrics(self) -> str:
        return httpx.get(f"{self.agent_url}/metrics", timeout=5).text


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    running = Agent(tmp_path)
    try:
        yield running
    finally:
        running.close()
