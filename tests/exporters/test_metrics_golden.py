"""`/metrics` against a golden file (node_exporter's collector fixtures do the same): every
family's name, type, help and label names, as a running agent (real BPF, an engine hook, a
tracked socket, the fake NVML's GPU) exports them, so a renamed metric or label is a reviewed
diff of tests/exporters/golden/metrics.txt, and the text passes `promtool check metrics`
(but for the DCGM-style GPU labels).
KVWATCH_UPDATE_GOLDEN=1 rewrites the file from the agent's output."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvwatch.config.load import load_config
from kvwatch.daemon.daemon import Daemon
from kvwatch.hook import CommandOutcome, EngineHook
from tests.collect.conftest import GIB, FakeGpu, FakeNvml
from tests.hookserver.conftest import ENGINE_INFO, run_async, wait_until

pytestmark = pytest.mark.bpf

GOLDEN = Path(__file__).with_name("golden") / "metrics.txt"
DECISION_SECONDS = 20.0
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? \S+")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')
# The one lint promtool raises that is kept on purpose: GPU labels spelled as NVIDIA's DCGM
# exporter spells them (`UUID`, `modelName`, `Hostname`: docs/contracts.md, "Metrics").
DCGM_LABELS = re.compile(r"^kvwatch_gpu_\w+ label names should be written in 'snake_case'")


def shape(exposition: str) -> str:
    """The exposition without its values: HELP and TYPE lines, and each sample's name with
    its label names (values change from run to run; names and labels are the contract)."""
    lines: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# HELP") or line.startswith("# TYPE"):
            lines.add(line)
            continue
        sample = SAMPLE.match(line)
        if sample is not None:
            labels = sorted(LABEL.findall(sample["labels"] or ""))
            lines.add(f"{sample['name']}{{{','.join(labels)}}}")
    return "\n".join(sorted(lines)) + "\n"


async def scrape(tmp_path: Path) -> str:
    """/metrics of an agent in enforce mode after one engine stream announced on a tracked
    connection stalled and was reset (so every family has its labels)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    config = load_config(
        None,
        {},
        {
            "collector.ports": (port,),
            "hook.socket": str(tmp_path / "engine.sock"),
            "audit.path": "",
            "policy.mode": "enforce",
            "policy.actions": ("reset",),
            "policy.grace_seconds": 0,
            "policy.stall_seconds": 0.5,
        },
    )
    nvml = FakeNvml([FakeGpu("GPU-0", "NVIDIA H100", 80 * GIB, 30 * GIB, [(os.getpid(), GIB)])])
    daemon = Daemon(config, nvml)
    await daemon.start()
    hook = EngineHook(
        ENGINE_INFO,
        lambda request_id, _: CommandOutcome(request_id, "unknown_request", 0, 0),
        config.hook.socket,
        reconnect_seconds=0.1,
    )
    hook.start()
    running = asyncio.create_task(daemon.run())
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
    client.connect(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.setblocking(False)
    try:
        hook.stream_opened("cmpl-golden", accepted.getsockname(), accepted.getpeername(), 2)
        await wait_until(lambda: daemon.hooks.live("cmpl-golden"))
        deadline = time.monotonic() + DECISION_SECONDS
        while not daemon.recorder.events_after(0):  # until the stall's decision and reset
            assert time.monotonic() < deadline, f"no decision on the stall in {DECISION_SECONDS} s"
            with contextlib.suppress(BlockingIOError, ConnectionError):
                accepted.send(b"data: token\n\n" * 64)  # the writer fills the client's window
            await asyncio.sleep(0.05)
        await wait_until(lambda: daemon.tally.outcomes.total() > 0, timeout_seconds=10)
        return generate_latest(daemon.registry).decode()
    finally:
        await asyncio.to_thread(hook.stop)
        client.close()
        accepted.close()
        server.close()
        daemon.stop()
        await running
        await daemon.close()


def test_metrics_match_the_golden_file_and_pass_promtool(tmp_path: Path) -> None:
    exposition: list[str] = []

    async def scenario() -> None:
        exposition.append(await scrape(tmp_path))

    run_async(scenario(), timeout_seconds=60)
    text = exposition[0]
    if os.environ.get("KVWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(shape(text))
    assert shape(text) == GOLDEN.read_text(), (
        f"/metrics changed shape: review, then rerun with KVWATCH_UPDATE_GOLDEN=1 ({GOLDEN})"
    )
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing (Debian's prometheus package)"
    checked = subprocess.run(  # its exit code says "lint problems" for the DCGM labels
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    problems = [
        line
        for line in (checked.stdout + checked.stderr).splitlines()
        if line and not DCGM_LABELS.match(line)
    ]
    assert not problems and checked.returncode in (0, 3), "\n".join(problems)
