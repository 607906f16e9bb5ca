"""`kvwatch explain` and `kvwatch streams` against a live agent: the evidence chain of a
cancelled request, in order, and the joined stream list."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from kvwatch.lab.harness.cut_stack import CutStack
from kvwatch.lab.waiting import wait_for

pytestmark = [pytest.mark.bpf, pytest.mark.engine, pytest.mark.slow]
CHAIN = [
    "accepted",
    "first_byte_from_engine",
    "first_byte_to_client",
    "zero_window_start",
    "stall_conditions_began",
    "stalled",
    "decision",
]
# After the decision, in either order: the engine frees the blocks, answers and resets the
# connection; the kernel's close can reach the agent before the engine's answer does.
AFTER_DECISION = {"cancel_acknowledged", "closed"}


def kvwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# Long enough for `kvwatch streams` to list the stream before its cut: each look starts the
# CLI, which took up to 3 s on a machine the parallel suite loads.
LISTED_STALL_SECONDS = 8.0


def test_streams_then_explain_of_a_cancelled_request_shows_the_whole_chain(stack: CutStack) -> None:
    stack.start_engine()
    stack.start_agent("--mode", "enforce", "--stall-seconds", str(LISTED_STALL_SECONDS))
    client = stack.spawn_stalled_client("held-1")

    def listed() -> dict[str, Any] | None:
        done = kvwatch("streams", "--json", "--url", stack.agent_url)
        assert done.returncode == 0, done.stderr
        return next((r for r in json.loads(done.stdout) if r["request_id"] == "cmpl-held-1"), None)

    # Until the engine's hook (re)connected and announced the stream (each look runs the CLI).
    row = wait_for(listed, 30, "`kvwatch streams` to list cmpl-held-1", poll_seconds=0.1)
    assert row["kv_blocks"] > 0 and row["engine"] == "kvwatch-reference"
    assert row["local"] == f"127.0.0.1:{stack.engine_port}"
    deadline = time.monotonic() + LISTED_STALL_SECONDS + 5
    chain: dict[str, Any] = {}
    while time.monotonic() < deadline:
        result = kvwatch("explain", "cmpl-held-1", "--json", "--url", stack.agent_url)
        chain = json.loads(result.stdout) if result.returncode == 0 else {}
        if not chain.get("live", True):
            break
        time.sleep(0.2)
    client.close()
    events = [e["event"] for e in chain["timeline"]]
    in_chain = [event for event in events if event in CHAIN]
    assert sorted(set(in_chain), key=CHAIN.index) == CHAIN, events
    # The cut's decision (reason "stalled") follows the stall; a hold's (a pause of a reader
    # that fell behind) may come before it.
    cut_at = next(
        i
        for i, entry in enumerate(chain["timeline"])
        if entry["event"] == "decision" and entry.get("reason") == "stalled"
    )
    assert events.index("stalled") < cut_at, events
    assert "engine_announced" in events
    assert set(events[cut_at + 1 :]) >= AFTER_DECISION, events
    text = kvwatch("explain", "cmpl-held-1", "--url", stack.agent_url)
    assert text.returncode == 0
    assert "engine acknowledged the cancel: cancelled" in text.stdout
    assert "peer_rwnd=0" in text.stdout
    missing = kvwatch("explain", "cmpl-nope", "--url", stack.agent_url)
    assert missing.returncode == 1 and "no stream with request id" in missing.stderr
