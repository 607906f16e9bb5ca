"""The incident tools as an operator runs them: `doctor` and `baseline` as subprocesses, against
a live engine + agent where it matters (tests/top/ shares the stalled stack)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvwatch.lab.harness.cut_stack import CutStack

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
def stalled_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CutStack]:
    """An engine and an agent (observe mode) with one client that stopped reading,
    already `stalled` in the agent's view. Shared by the top and doctor tests, stopped when
    the tests of this package are done."""
    stack = CutStack(tmp_path_factory.mktemp("stack"))
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
