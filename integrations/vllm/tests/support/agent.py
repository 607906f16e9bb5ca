"""The kvwatch agent (`kvwatch run`) as a subprocess, from the project's own venv: this venv
has vLLM and the light hook wheel, not the agent (docs/engines.md). It watches one port, listens
for engines on a hook socket of its own, and serves its API on a port of its own; the test
reads its audit log, its API (/healthz, /api/v1/streams) and its metrics."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.server import INTEGRATION_DIR, free_port

REPOSITORY = INTEGRATION_DIR.parents[1]
# The agent's command; KVWATCH_AGENT names another (the project's venv is the default).
AGENT_ENV = "KVWATCH_AGENT"
DEFAULT_AGENT = REPOSITORY / ".venv" / "bin" / "kvwatch"
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0


def agent_command() -> Path:
    return Path(os.environ.get(AGENT_ENV) or DEFAULT_AGENT)


def agent_unavailable_reason() -> str | None:
    """Why `kvwatch run` with BPF cannot run here, or None."""
    if os.geteuid() != 0:
        return "the agent's BPF collector needs root"
    if not agent_command().is_file():
        return f"no agent at {agent_command()} (run `make setup`, or set {AGENT_ENV})"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "the kernel exposes no BTF (/sys/kernel/btf/vmlinux)"
    return None


@dataclass
class Agent:
    """A running `kvwatch run`."""

    process: subprocess.Popen[bytes]
    api_port: int
    audit_path: Path
    log_path: Path

    def get(self, path: str) -> Any:
        return json.loads(self._get(path))

    def metric(self, name: str) -> float:
        """The value of the agent's unlabelled metric `name` (GET /metrics)."""
        text = self._get("/metrics").decode()
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert found is not None, f"no metric {name}"
        return float(found[1])

    def _get(self, path: str) -> bytes:
        connection = http.client.HTTPConnection("127.0.0.1", self.api_port, timeout=10)
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, (path, response.status, body[:200])
        return body

    def audit(self, kind: str | None = None, request_id: str | None = None) -> list[dict[str, Any]]:
        """The audit log's entries, optionally of one kind and one request."""
        if not self.audit_path.exists():
            return []
        entries = [json.loads(line) for line in self.audit_path.read_text().splitlines() if line]
        return [
            e
            for e in entries
            if (kind is None or e["kind"] == kind)
            and (request_id is None or e.get("request_id") == request_id)
        ]

    def outcomes(self, request_id: str) -> list[tuple[str, str]]:
        """(action, status) of each outcome the agent wrote for the request, in order."""
        return [(e["action"], e["result"]["status"]) for e in self.audit("outcome", request_id)]

    def outcome(self, request_id: str, action: str, status: str) -> dict[str, Any] | None:
        """The first outcome line of `action` answered `status` for the request."""
        return next(
            (
                e
                for e in self.audit("outcome", request_id)
                if (e["action"], e["result"]["status"]) == (action, status)
            ),
            None,
        )

    def engines(self) -> list[dict[str, Any]]:
        engines: list[dict[str, Any]] = self.get("/healthz").get("engines") or []
        return engines

    def stream(self, request_id: str) -> dict[str, Any] | None:
        """The agent's row for the request (GET /api/v1/streams), None when it has none."""
        rows: list[dict[str, Any]] = self.get("/api/v1/streams")
        return next((row for row in rows if row.get("request_id") == request_id), None)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def kvwatch_agent(work_dir: Path, port: int, hook_socket: Path, *args: str) -> Iterator[Agent]:
    """`kvwatch run --port PORT --hook-socket HOOK_SOCKET ARGS...` with its API on a free
    port and its audit log in `work_dir`, until the `with` ends."""
    api_port = free_port()
    audit_path, log_path = work_dir / "audit.jsonl", work_dir / "agent.log"
    command = [
        str(agent_command()), "run", "--port", str(port), "--hook-socket", str(hook_socket),
        "--listen", f"127.0.0.1:{api_port}", "--audit-log", str(audit_path), *args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    agent = Agent(process, api_port, audit_path, log_path)
    try:
        _wait_up(agent)
        yield agent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_up(agent: Agent) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if agent.process.poll() is not None:
            raise AssertionError(f"kvwatch run exited:\n{agent.log_tail()}")
        try:
            agent.get("/healthz")
            return
        except (OSError, AssertionError):
            time.sleep(0.2)
    raise AssertionError(f"kvwatch run did not answer in {START_TIMEOUT_SECONDS} s")
