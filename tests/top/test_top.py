"""`kvwatch top`: on a real terminal against a live daemon, piped, standalone, and its parts."""

from __future__ import annotations

import io
import re
import subprocess

import httpx
import pytest
from rich.console import Console

from kvwatch.lab.harness.cut_stack import CutStack
from kvwatch.lab.harness.scenario import Scenario
from kvwatch.tools.tables import human_bytes
from kvwatch.top.keys import KEYS_HELP, Controls
from kvwatch.top.model import CancelRate, Frame, Header, RowFilter, parse_metrics
from kvwatch.top.render import COLUMNS, render_frame
from tests.tools.conftest import KVWATCH, STALLED_REQUEST, kvwatch
from tests.top.conftest import Terminal


def row_line(screen: str, needle: str) -> str:
    return next(line for line in screen.splitlines() if needle in line)


@pytest.mark.bpf
@pytest.mark.engine
def test_top_on_a_terminal_shows_the_stalled_stream_and_obeys_keys(
    stalled_stack: CutStack, terminal: Terminal
) -> None:
    terminal.start([*KVWATCH, "top", "--url", stalled_stack.agent_url, "--interval", "0.5"])
    screen = terminal.wait_for(STALLED_REQUEST)
    row = row_line(screen, STALLED_REQUEST)
    assert "stalled" in row.split()
    assert f":{stalled_stack.engine_port}→127.0.0.1:" in row
    header = row_line(screen, "STATE")
    behind = row[header.index("BEHIND") :].split()[0]  # right-aligned under its header
    # Its reader has not read that much: seconds of its output where the agent measured its
    # rate (a stream stopped early may have none), else bytes.
    assert re.fullmatch(r"[0-9.]+(s|B|K|M|G)", behind) and float(behind[:-1]) > 0, behind
    assert "mode observe" in screen
    assert "stalled 1 holding KV" in screen
    assert "attach points send=" in screen
    assert KEYS_HELP in screen
    assert all(len(line) <= 80 for line in screen.splitlines())
    styled = row_line(terminal.screen(with_styles=True), STALLED_REQUEST)
    assert "\x1b[1m\x1b[31mstalled" in styled or "\x1b[1;31mstalled" in styled, repr(styled)
    terminal.keys("t")  # state filter: stalled
    assert STALLED_REQUEST in terminal.wait_for("state stalled")
    terminal.keys("t")  # state filter: zero_window; the stalled row goes
    screen = terminal.wait_for("state zero_window")
    assert STALLED_REQUEST not in screen
    terminal.keys("c", "p", "1", "Enter")  # clear, then port 1: nothing matches
    screen = terminal.wait_for("port 1")
    assert "shown 0" in screen
    terminal.keys("p", "Enter", "s")  # empty entry clears the port; next sort
    screen = terminal.wait_for("sort state")
    assert STALLED_REQUEST in screen
    terminal.keys("q")
    terminal.wait_for("kvwatch-exited=0")


@pytest.mark.bpf
@pytest.mark.engine
def test_top_once_piped_is_plain_text_that_fits(stalled_stack: CutStack) -> None:
    result = kvwatch("top", "--url", stalled_stack.agent_url, "--once", "--state", "stalled")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines())
    row = row_line(result.stdout, STALLED_REQUEST)
    assert "stalled" in row.split()
    streams = httpx.get(f"{stalled_stack.agent_url}/api/v1/streams", timeout=2).json()
    held = next(s for s in streams if s["request_id"] == STALLED_REQUEST)
    assert f"{held['kv_blocks']}/{human_bytes(held['kv_bytes'])}" in row.split()  # KV
    wide = kvwatch("top", "--url", stalled_stack.agent_url, "--once", env={"COLUMNS": "160"})
    header = row_line(wide.stdout, "PID/COMM").split()
    assert header == [c.header for c in COLUMNS]


def test_top_without_a_daemon_says_how_to_start_one() -> None:
    result = kvwatch("top", "--url", "http://127.0.0.1:9", "--once")
    assert result.returncode == 1
    assert "does not answer" in result.stderr
    assert "kvwatch run" in result.stderr
    assert "--standalone" in result.stderr


@pytest.mark.bpf
def test_top_standalone_once_finds_a_loopback_stall() -> None:
    with Scenario() as scenario:
        top = subprocess.Popen(
            [
                *KVWATCH,
                "top",
                "--standalone",
                "--once",
                "--port",
                str(scenario.port),
                "--stall-seconds",
                "0.5",
                "--settle",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert top.stderr is not None
            assert "BPF attach points" in top.stderr.readline()  # the collector is ready
            stalled = scenario.connect("stalled")
            healthy = scenario.connect("healthy")
            out, _ = top.communicate(timeout=30)
        finally:
            top.kill()
            top.wait()
    assert top.returncode == 0
    assert "standalone (core)" in out
    assert "stalled" in row_line(out, f"127.0.0.1:{stalled.local_port}").split()
    assert "stalled" not in row_line(out, f"127.0.0.1:{healthy.local_port}").split()
    assert "holding KV unknown" in out  # no engine hook: KV is not guessed


def stream_row(state: str, port: int, **extra: object) -> dict[str, object]:
    return {
        "local": "10.0.0.1:8000",
        "remote": f"192.168.1.7:{port}",
        "pid": 4242,
        "comm": "engine",
        "state": state,
        "wmem_queued": 900,
        "sndbuf": 1000,
        "notsent_bytes": 2048,
        "unacked_bytes": 512,
        "peer_rwnd": 0,
        "srtt_us": 25_000,
        "zero_window_seconds": 4.0,
        "no_progress_seconds": 4.0 if state == "stalled" else 0.0,
        "request_id": f"cmpl-{state}-{port}",
        "kv_blocks": 10,
        "kv_bytes": 10 << 20,
        "age_seconds": 75.0,
        **extra,
    }


def render(frame: Frame, view: RowFilter, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width).print(render_frame(frame, view, width, []))
    return out.getvalue()


@pytest.mark.parametrize("width", [60, 80, 100, 160])
def test_frames_fit_the_width_dropping_the_least_important_columns(width: int) -> None:
    header = Header("daemon x", "enforce", {"send": "fentry"}, (), 10 << 20, 2.0)
    rows = [stream_row("stalled", 50000), stream_row("zero_window", 50001, kv_blocks=None)]
    text = render(Frame(header, rows), RowFilter(), width)
    assert all(len(line) <= width for line in text.splitlines()), text
    headers = next(line for line in text.splitlines() if "CONNECTION" in line).split()
    assert {"STATE", "REQUEST"} <= set(headers)
    assert ("SRTT" in headers) is (width >= 120)
    if width >= 120:
        assert headers == [c.header for c in COLUMNS]
        assert "1m15s" in text  # AGE
    assert "stalled 1 holding KV 10.0M" in text


def test_a_stream_whose_action_failed_on_every_try_says_so() -> None:
    header = Header("daemon x", "enforce", {"send": "fentry"}, (), 10 << 20, 2.0)
    failed = {"actions": ["reset"], "tries": 4, "decision_id": "x-1"}
    rows = [stream_row("stalled", 50000, action_failed=failed), stream_row("stalled", 50001)]
    text = render(Frame(header, rows), RowFilter(), 160)
    assert "stalled (action failed)" in row_line(text, "192.168.1.7:50000")
    assert "action failed" not in row_line(text, "192.168.1.7:50001")


def test_a_parked_stream_says_so_and_the_header_counts_it() -> None:
    header = Header("daemon x", "enforce", {"send": "fentry"}, (), 0, 0.0)
    rows = [stream_row("zero_window", 50000, parked=True), stream_row("zero_window", 50001)]
    text = render(Frame(header, rows), RowFilter(), 160)
    assert "zero_window (parked)" in row_line(text, "192.168.1.7:50000")
    assert "parked" not in row_line(text, "192.168.1.7:50001")
    assert "parked 1" in text


def test_filters_and_sorts() -> None:
    rows = [
        stream_row("healthy", 1, pid=1, kv_bytes=1),
        stream_row("stalled", 2, pid=2, kv_bytes=5),
        stream_row("zero_window", 3, pid=3, kv_bytes=9),
    ]
    assert [r["state"] for r in RowFilter(sort="state").apply(rows)] == [
        "stalled",
        "zero_window",
        "healthy",
    ]
    assert [r["pid"] for r in RowFilter(sort="kv", reverse=True).apply(rows)] == [1, 2, 3]
    assert [r["pid"] for r in RowFilter(ports=(3,)).apply(rows)] == [3]
    assert [r["pid"] for r in RowFilter(ports=(8000,), pid=2).apply(rows)] == [2]
    assert RowFilter(states=("slow",)).apply(rows) == []


def test_keys_change_the_view() -> None:
    controls = Controls(RowFilter())
    controls.press("s")
    assert controls.view.sort == "state"
    controls.press("tt")
    assert controls.view.states == ("zero_window",)
    controls.press("i42\x7f3\r")
    assert controls.view.pid == 43
    controls.press("p80")
    assert controls.footer().startswith("port: 80_")
    controls.press("\x1b")  # Esc cancels the entry
    assert controls.view.ports == () and not controls.prompt
    controls.press("\x1b[A")  # an arrow key does nothing
    controls.press("c")
    assert controls.view == RowFilter(sort="state")
    controls.press("q")
    assert controls.quit


def test_metrics_give_gpu_memory_and_cancels() -> None:
    text = "\n".join(
        [
            "kvwatch_gpu_nvml_available 1.0",
            'kvwatch_gpu_memory_used_bytes{gpu="1",UUID="b"} 4e9',
            'kvwatch_gpu_memory_total_bytes{gpu="1",UUID="b"} 8e9',
            'kvwatch_gpu_memory_used_bytes{gpu="0",UUID="a"} 1e9',
            'kvwatch_gpu_memory_total_bytes{gpu="0",UUID="a"} 8e9',
            "# TYPE kvwatch_actions counter",
            'kvwatch_actions_total{action="cancel",reason="stalled",result="cancelled"} 3.0',
            'kvwatch_actions_total{action="cancel",reason="stalled",result="failed"} 5.0',
            'kvwatch_actions_total{action="reset",reason="stalled",result="reset"} 7.0',
            "",
        ]
    )
    facts = parse_metrics(text)
    assert facts.cancels_total == 3
    assert facts.gpus is not None
    assert [(g.gpu, g.used_bytes) for g in facts.gpus] == [("0", 10**9), ("1", 4 * 10**9)]
    assert parse_metrics("kvwatch_gpu_nvml_available 0.0\n").gpus is None
    rate = CancelRate()
    assert rate.update(3, uptime_seconds=120, now=0.0) == 1.5  # since start
    assert rate.update(9, uptime_seconds=150, now=30.0) == 12.0  # 6 in 30 s
