"""The reference engine and the agent as real subprocesses, on loopback: start them, wait
until they answer, read the agent's audit log, stop them. Used by `kvwatch demo`, the
end-to-end tests and the benchmarks.

Every process writes its output to a log file in the stack's work directory (say which one
when something fails); `Stack.close` (or leaving the `with`) stops them, newest first.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvwatch.errors import KvwatchError

STOP_SECONDS = 10.0
STARTUP_SECONDS = 60.0
ENGINE_HELLO_SECONDS = 10.0


def wait_until_up(url: str, process: subprocess.Popen[bytes], what: str) -> None:
    """Until `url` answers 200; a clear error if the process exits or never answers."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise KvwatchError(
                f"{what} exited with status {process.returncode} at start-up",
                "read its log (the path is in the message)",
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise KvwatchError(
        f"{what} did not answer at {url} within {STARTUP_SECONDS:.0f} s",
        "check the machine's load and the ports in use",
    )


def kvwatch_command() -> list[str]:
    """How to run this kvwatch as a subprocess (the same interpreter and package)."""
    return [sys.executable, "-m", "kvwatch.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Service:
    """One `python -m kvwatch.cli ...` subprocess and the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Stack:
    """An engine and agents in one work directory; owns every process it starts.

    The engine's port and hook socket stay the same for the stack's life, so an agent can be
    stopped and another started (in another mode) while the engine keeps running: the engine
    reconnects to the hook socket by itself. Each agent writes its own audit log."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.hook_socket = workdir / "engine.sock"
        self.engine_port = free_port()
        self.agent_port = free_port()
        self.audit = workdir / "audit.jsonl"
        self.services: list[Service] = []

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Service:
        log = self.workdir / f"{name}-{len(self.services)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [*kvwatch_command(), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        service = Service(name, popen, log)
        self.services.append(service)
        return service

    def start_engine(self, *args: str) -> Service:
        """`kvwatch engine` on this stack's port and hook socket, plus `args`."""
        engine = self.spawn(
            "engine",
            [
                "engine",
                "--port",
                str(self.engine_port),
                "--kvwatch-socket",
                str(self.hook_socket),
                *args,
            ],
        )
        wait_until_up(f"{self.engine_url}/health", engine.popen, f"the engine ({engine.log})")
        return engine

    def start_agent(
        self,
        *args: str,
        port: int | None = None,
        audit: str = "",
        env: dict[str, str] | None = None,
    ) -> Service:
        """`kvwatch run` watching `port` (default: the engine's), plus `args`. `audit` names
        the audit log file in the work directory ("" : audit.jsonl); `env` adds variables."""
        self.audit = self.workdir / (audit or "audit.jsonl")
        agent = self.spawn(
            "agent",
            [
                "run",
                "--port",
                str(port or self.engine_port),
                "--hook-socket",
                str(self.hook_socket),
                "--listen",
                f"127.0.0.1:{self.agent_port}",
                "--audit-log",
                str(self.audit),
                *args,
            ],
            env,
        )
        wait_until_up(f"{self.agent_url}/healthz", agent.popen, f"the agent ({agent.log})")
        return agent

    def wait_engine_connected(self) -> None:
        """Until the agent lists an engine on its hook socket."""
        deadline = time.monotonic() + ENGINE_HELLO_SECONDS
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.agent_url}/healthz", timeout=1.0).json().get("engines"):
                    return
            time.sleep(0.1)
        raise KvwatchError(
            f"no engine connected to the agent's hook socket within {ENGINE_HELLO_SECONDS} s",
            f"read the engine's log in {self.workdir}",
        )

    def audit_entries(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The current agent's audit log, optionally only the lines of one `kind`."""
        if not self.audit.exists():
            return []
        text = self.audit.read_text()
        # The agent may be writing a line as it is read: only whole lines are parsed.
        whole = text[: text.rfind("\n") + 1]
        entries = [json.loads(line) for line in whole.splitlines() if line]
        return [e for e in entries if kind is None or e["kind"] == kind]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each running service has used so far, by name."""
        used: dict[str, float] = {}
        for service in self.services:
            times = psutil.Process(service.pid).cpu_times()
            used[service.name] = times.user + times.system
        return used

    def stop(self, service: Service) -> None:
        service.stop()
        self.services.remove(service)

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
