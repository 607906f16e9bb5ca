"""The real thing, end to end: the reference engine and the agent as processes, clients from
the load generator, everything on loopback. Requests carry X-Request-Id `<class>-…`, so the
engine's request IDs (`cmpl-stalled-…`) tell which client a decision was about."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.loadgen import LoadPlan, LoadReport, run_load
from kvwatch.loadgen.http import Target, build_request, completion_body

ENGINE_ARGS = [
    "--model-size",
    "tiny",
    "--egress",
    "coupled",
    "--kv-blocks",
    "160",
    "--sndbuf-bytes",
    "8192",
    "--max-tokens-limit",
    "4000",
]
STALL_SECONDS = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_seconds: float = 60) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, f"process for {url} exited with {process.returncode}"
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


@dataclass
class Process:
    """A kvwatch subprocess; stopped at teardown."""

    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Stack:
    """An engine and an agent wired together in a temporary directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = workdir / "engine.sock"
        self.audit = workdir / "audit.jsonl"
        self.engine_port = free_port()
        self.agent_port = free_port()
        self.processes: list[Process] = []

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.workdir / f"{name}-{len(self.processes)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "kvwatch.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        process = Process(popen, log)
        self.processes.append(process)
        return process

    def start_engine(self, *extra: str) -> Process:
        engine = self.spawn(
            "engine",
            [
                "engine",
                "--port",
                str(self.engine_port),
                *ENGINE_ARGS,
                "--kvwatch-socket",
                str(self.socket),
                *extra,
            ],
        )
        wait_http(f"{self.engine_url}/health", engine.popen)
        return engine

    def start_agent(self, *extra: str, env: dict[str, str] | None = None) -> Process:
        agent = self.spawn(
            "agent",
            [
                "run",
                "--port",
                str(self.engine_port),
                "--stall-seconds",
                str(STALL_SECONDS),
                "--grace-seconds",
                "0",
                "--hook-socket",
                str(self.socket),
                "--listen",
                f"127.0.0.1:{self.agent_port}",
                "--audit-log",
                str(self.audit),
                *extra,
            ],
            env=env,
        )
        wait_http(f"{self.agent_url}/healthz", agent.popen)
        return agent

    def load(
        self,
        seconds: float,
        healthy: int = 2,
        slow: int = 1,
        stalled: int = 2,
        max_tokens: int = 1500,
    ) -> LoadReport:
        plan = LoadPlan(
            url=self.engine_url,
            healthy=healthy,
            slow=slow,
            stalled=stalled,
            duration_seconds=seconds,
            max_tokens=max_tokens,
            slow_bytes_per_second=8192,
            rcvbuf_bytes=4096,
        )
        return asyncio.run(run_load(plan))

    def spawn_stalled_client(self, request_id: str = "held-1") -> socket.socket:
        """A client that asks for a long stream, reads its first bytes, then stops reading."""
        body = completion_body("completions", "kvwatch-reference-tiny", "Tell me a story.", 1500)
        request = build_request(
            Target.parse(self.engine_url), "POST", "/v1/completions", body, request_id
        )
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", self.engine_port))
        client.sendall(request)
        assert client.recv(256), "the stream started"
        return client

    def audit_entries(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.audit.exists():
            return []
        entries = [json.loads(line) for line in self.audit.read_text().splitlines() if line]
        return [e for e in entries if kind is None or e["kind"] == kind]

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    running = Stack(tmp_path)
    yield running
    running.close()
