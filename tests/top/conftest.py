"""`kvwatch top` in a real terminal (tmux), against the live engine + agent of tests/tools/."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.tools.conftest import stalled_stack

__all__ = ["stalled_stack"]  # the same fixture, started once for this package


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
