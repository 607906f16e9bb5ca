"""The `sockets` and `doctor` commands as users run them: real processes, real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.collect.bpf.loader import SEND_MODES, tracepoint_mode_for_kernel
from kvwatch.errors import EXIT_PRIVILEGE
from kvwatch.lab.harness.scenario import Scenario
from tests.collect.bpf.conftest import READING_FLAVOURS

KVWATCH = [sys.executable, "-m", "kvwatch.cli"]
# Every capability dropped, uid kept: a process that may read the checkout wherever CI put
# it, but may not load BPF — what an unprivileged user gets.
WITHOUT_PRIVILEGES = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
CONTRACT_FIELDS = {
    "local",
    "remote",
    "pid",
    "comm",
    "state",
    "wmem_queued",
    "sndbuf",
    "notsent_bytes",
    "unacked_bytes",
    "peer_rwnd",
    "srtt_us",
    "retransmits",
    "zero_window",
    "zero_window_episodes",
    "zero_window_seconds",
    "sndbuf_full",
    "no_progress_seconds",
    "source",
}


def kvwatch(
    *args: str, unprivileged: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    prefix = WITHOUT_PRIVILEGES if unprivileged else []
    full_env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    return subprocess.run(
        [*prefix, *KVWATCH, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=full_env,
        check=False,
    )


def row_for(rows: list[dict[str, object]], client_port: int) -> dict[str, object]:
    return next(r for r in rows if str(r["remote"]).endswith(f":{client_port}"))


@pytest.mark.bpf
def test_sockets_json_shows_a_stalled_stream() -> None:
    with Scenario() as scenario:
        stalled = scenario.connect("stalled")
        healthy = scenario.connect("healthy")
        result = kvwatch(
            "sockets",
            "--json",
            "--port",
            str(scenario.port),
            "--stall-seconds",
            "0.5",
            "--settle",
            "1.5",
        )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert all(row.keys() >= CONTRACT_FIELDS for row in rows)
    stalled_row = row_for(rows, stalled.local_port)
    assert stalled_row["state"] == "stalled"
    assert stalled_row["zero_window"] is True
    assert stalled_row["peer_rwnd"] == 0
    assert stalled_row["local"] == f"127.0.0.1:{scenario.port}"
    assert stalled_row["pid"] == os.getpid()
    assert row_for(rows, healthy.local_port)["state"] != "stalled"


def test_without_privileges_core_fails_with_exit_3_and_diag_still_lists() -> None:
    with Scenario() as scenario:
        stalled = scenario.connect("stalled")
        refused = kvwatch(
            "sockets", "--backend", "core", "--port", str(scenario.port), unprivileged=True
        )
        fallback = kvwatch(
            "sockets", "--json", "--port", str(scenario.port), "--settle", "0.2", unprivileged=True
        )
    assert refused.returncode == EXIT_PRIVILEGE
    assert "not allowed to load BPF programs" in refused.stderr
    assert "CAP_BPF" in refused.stderr
    assert fallback.returncode == 0, fallback.stderr
    assert "falling back to sock_diag" in fallback.stderr
    row = row_for(json.loads(fallback.stdout), stalled.local_port)
    assert row["source"] == "inet_diag"
    assert row["zero_window"] is True


@pytest.mark.bpf
def test_doctor_reports_this_kernels_modes_truthfully() -> None:
    result = kvwatch("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True
    assert checks["send attach point: raw_tp"]["status"] == "ok"
    auto = checks["send attach point (auto)"]["detail"]
    best = next(m for m in SEND_MODES if checks[f"send attach point: {m}"]["status"] == "ok")
    assert auto == f"auto picks {best}"
    assert checks["ack attach point"]["detail"] == tracepoint_mode_for_kernel() == "tp_btf"


def test_doctor_without_privileges_exits_3_with_a_fix() -> None:
    result = kvwatch("doctor", "--json", unprivileged=True)
    assert result.returncode == EXIT_PRIVILEGE
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["privileges"]["status"] == "fail"
    assert "CAP_BPF" in checks["privileges"]["fix"]


def test_require_bpf_turns_a_skip_into_a_failure() -> None:
    layout_test = str(Path(__file__).parents[1] / "collect" / "bpf" / "test_stream_states.py")
    base = [
        *WITHOUT_PRIVILEGES,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        layout_test,
        "-k",
        "idle",
    ]
    env = {k: v for k, v in os.environ.items() if k != "KVWATCH_REQUIRE_BPF"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    skipped = subprocess.run(
        base,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    required = subprocess.run(
        base,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, "KVWATCH_REQUIRE_BPF": "1"},
        cwd=Path(__file__).parents[2],
    )
    flavours = len(READING_FLAVOURS)  # the one test runs once per reading flavour
    assert skipped.returncode == 0 and f"{flavours} skipped" in skipped.stdout, skipped.stdout
    assert required.returncode == 1, required.stdout
    assert "BPF test cannot run: no CAP_BPF or CAP_SYS_ADMIN" in required.stdout
