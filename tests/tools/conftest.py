"""The incident tools as an operator runs them: `kvwatch top` in a real terminal (tmux),
`doctor` and `baseline` as subprocesses, against a live engine + agent where it matters."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.conftest import Stack

KVWATCH = [sys.executable, "-m", "kvwatch.cli"]
STALLED_REQUEST = "cmpl-held-1"


def kvwatch(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVWATCH, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
        check=False,
    )


def wait_until_stalled(agent_url: str, request_id: str, timeout_seconds: float = 15) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        streams = httpx.get(f"{agent_url}/api/v1/streams", timeout=2).json()
        if any(s["request_id"] == request_id and s["state"] == "stalled" for s in streams):
            return
        time.sleep(0.2)
    raise AssertionError(f"{request_id} never showed as stalled: {streams}")


@pytest.fixture(scope="package")
def stalled_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An engine and an agent (observe mode) with one client that stopped reading,
    already `stalled` in the agent's view. Shared by the top and doctor tests, stopped when
    the tests of this package are done."""
    stack = Stack(tmp_path_factory.mktemp("stack"))
    try:
        stack.start_engine()
        stack.start_agent()
        client = stack.spawn_stalled_client()
        try:
            wait_until_stalled(stack.agent_url, STALLED_REQUEST)
            yield stack
        finally:
            client.close()
    finally:
        stack.close()


@dataclass
class Terminal:
    """A tmux server of our own (its own socket) running one command in an 80x24 pane."""

    name: str

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.name, *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start(self, command: list[str], width: int = 80, height: int = 24) -> None:
        # After the command exits, its status stays on screen (the pane stays open).
        shell = f"{shlex.join(command)}; echo kvwatch-exited=$?; sleep 600"
        self.tmux("new-session", "-d", "-x", str(width), "-y", str(height), "-s", "t", shell)

    def screen(self, with_styles: bool = False) -> str:
        """The visible pane; `with_styles` keeps the SGR codes of colours and bold."""
        return self.tmux("capture-pane", "-p", *(["-e"] if with_styles else []), "-t", "t")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, check: str, timeout_seconds: float = 10) -> str:
        deadline = time.monotonic() + timeout_seconds
        while True:
            screen = self.screen()
            if check in screen:
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{check!r} never appeared on screen:\n{screen}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.name, "kill-server"], capture_output=True, check=False)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    term = Terminal(f"kvwatch-test-{os.getpid()}")
    yield term
    term.close()
