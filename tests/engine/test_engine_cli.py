"""`kvwatch engine` as a process: what it prints, that it serves, that SIGTERM and SIGINT stop
it cleanly (exit 0) even with a stalled stream open."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.engine.conftest import StalledClient

pytestmark = pytest.mark.engine

RUN_ENGINE = "from kvwatch.cli.engine_cmd import command; command()"


@pytest.fixture
def engine_process() -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", RUN_ENGINE, "--port", "0", "--model-size", "tiny",
         "--kv-blocks", "64", "--sndbuf-bytes", "4096", "--no-kvwatch-hook"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()
    assert process.stderr is not None
    process.stderr.close()


def read_banner(process: subprocess.Popen[str]) -> tuple[str, list[str]]:
    assert process.stderr is not None
    lines: list[str] = []
    while not any("kvwatch hook:" in line for line in lines):
        line = process.stderr.readline()
        assert line, f"engine exited early: {lines}"
        lines.append(line)
    match = re.search(r"on (http://\S+)", lines[0])
    assert match is not None, lines
    return match.group(1), lines


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_engine_prints_its_pool_serves_and_stops_cleanly_on_signal(
    engine_process: subprocess.Popen[str], signum: signal.Signals
) -> None:
    url, banner = read_banner(engine_process)
    text = "".join(banner)
    assert "kvwatch-reference-tiny" in text
    assert "KV pool: 64 blocks x 16 tokens, 32768 bytes per block, 2.0 MiB in all" in text
    assert "SSE writes: coalesced up to 1024 bytes or 500 ms" in text
    assert "kvwatch hook: off" in text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "s", "max_tokens": 900, "stream": True}).encode()
    stalled = StalledClient(("127.0.0.1", port), body, request_id="held")
    try:
        engine_process.send_signal(signum)
        assert engine_process.wait(timeout=20) == 0
    finally:
        stalled.close()
    assert engine_process.stderr is not None
    assert "kvwatch engine: stopped" in engine_process.stderr.read()
