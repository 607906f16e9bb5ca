"""`kvwatch doctor`'s node checks: GPUs, backpressure sysctls, the daemon, the hook socket."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from kvwatch.collect.bpf.loader import tracepoint_mode_for_kernel
from kvwatch.collect.gpu import GpuInventory
from kvwatch.lab.harness.cut_stack import CutStack
from kvwatch.lab.harness.stack import free_port
from kvwatch.tools.baseline import read_sysctl
from kvwatch.tools.doctor import (
    check_daemon,
    check_engines,
    check_gpus,
    check_hook_socket,
    check_procfs,
    check_sysctls,
    fetch_health,
    judge_sysctl,
    who_can_connect,
)
from tests.collect.conftest import GIB, FakeGpu, FakeNvml
from tests.fuzz.servers import garbage_server
from tests.tools.conftest import kvwatch


def checks_of(*args: str) -> tuple[int, dict[str, dict[str, str]]]:
    result = kvwatch("doctor", "--json", *args)
    report = json.loads(result.stdout)
    assert report["ok"] is (result.returncode == 0), result.stderr
    return result.returncode, {c["name"]: c for c in report["checks"]}


@pytest.mark.bpf
def test_doctor_on_this_node_without_a_daemon(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, checks = checks_of("--url", url, "--hook-socket", str(tmp_path / "engine.sock"))
    assert code == 0  # no daemon, no GPU: nothing that stops the agent from running
    assert checks["send attach point: raw_tp"]["status"] == "ok"
    assert checks["ack attach point"]["detail"] == tracepoint_mode_for_kernel()
    daemon = checks["daemon"]
    assert daemon["status"] == "warn"
    assert url in daemon["detail"]
    assert "kvwatch run" in daemon["fix"]
    assert checks["engine hook socket"]["status"] == "info"
    assert "does not exist" in checks["engine hook socket"]["detail"]
    assert checks["engines"]["detail"].startswith("unknown")
    inventory = GpuInventory()
    expected = "ok" if inventory.available else "info"
    inventory.close()
    assert checks["NVML"]["status"] == expected
    wmem = read_sysctl("/proc", "net.ipv4.tcp_wmem")
    assert wmem is not None and checks["tcp_wmem"]["detail"].startswith(wmem)
    assert {"tcp_rmem", "tcp_notsent_lowat", "tcp_moderate_rcvbuf"} <= checks.keys()


@pytest.mark.bpf
@pytest.mark.engine
def test_doctor_sees_the_running_daemon_and_its_engine(stalled_stack: CutStack) -> None:
    code, checks = checks_of(
        "--url", stalled_stack.agent_url, "--hook-socket", str(stalled_stack.hook_socket)
    )
    assert code == 0
    assert checks["daemon"]["status"] == "ok"
    assert "mode observe" in checks["daemon"]["detail"]
    hook = checks["engine hook socket"]
    assert hook["status"] == "ok"
    assert "mode 0660" in hook["detail"] and "listening" in hook["detail"]
    engines = checks["engines"]
    assert engines["status"] == "ok"
    assert engines["detail"].startswith("1 connected: kvwatch-reference")
    assert "1 stream(s)" in engines["detail"]


def test_no_nvml_is_information_and_gpus_are_listed() -> None:
    missing = GpuInventory(FakeNvml([], init_error="NVML Shared Library Not Found"))
    (line,) = check_gpus(missing)
    assert (line.name, line.status) == ("NVML", "info")
    assert "Shared Library Not Found" in line.detail
    gpu = FakeGpu("GPU-a", "NVIDIA H200", 141 * GIB, 30 * GIB, [(7, GIB)])
    nvml, first = check_gpus(GpuInventory(FakeNvml([gpu])))
    assert (nvml.status, first.name, first.status) == ("ok", "GPU 0", "ok")
    assert first.detail == "NVIDIA H200: HBM 30.0G of 141.0G used, 1 compute process(es)"


@pytest.mark.parametrize(
    ("name", "value", "status", "words"),
    [
        ("net.ipv4.tcp_wmem", "4096\t16384\t4194304", "ok", "up to 4.0M"),
        ("net.ipv4.tcp_wmem", "4096 16384 67108864", "warn", "hides stalls"),
        ("net.ipv4.tcp_notsent_lowat", "4294967295", "info", "unlimited"),
        ("net.ipv4.tcp_notsent_lowat", "131072", "ok", "more than 128.0K is unsent"),
        ("net.ipv4.tcp_rmem", "4096 131072 6291456", "info", "up to 6.0M"),
        ("net.ipv4.tcp_moderate_rcvbuf", "0", "info", "autotuning off"),
        ("net.ipv4.tcp_moderate_rcvbuf", None, "info", "not present"),
        ("net.ipv4.tcp_wmem", "4096 lots", "warn", "unexpected value"),
    ],
)
def test_sysctl_judgements(name: str, value: str | None, status: str, words: str) -> None:
    check = judge_sysctl(name, value)
    assert check.name == name.rpartition(".")[2]
    assert check.status == status
    assert words in check.detail
    assert (status == "warn") is bool(check.fix)


def test_sysctls_are_read_under_the_procfs_option(tmp_path: Path) -> None:
    ipv4 = tmp_path / "sys" / "net" / "ipv4"
    ipv4.mkdir(parents=True)
    (ipv4 / "tcp_wmem").write_text("4096\t16384\t16777216\n")
    checks = {c.name: c for c in check_sysctls(str(tmp_path))}
    assert checks["tcp_wmem"].status == "warn"
    assert checks["tcp_rmem"].detail.startswith("not present")


def test_who_can_connect_follows_write_permission() -> None:
    assert who_can_connect(0o660, "root", "kvwatch") == "root and members of group kvwatch"
    assert who_can_connect(0o600, "svc", "svc") == "root and user svc"
    assert who_can_connect(0o666, "root", "root") == "any local user"


def test_hook_socket_states(tmp_path: Path) -> None:
    regular = tmp_path / "engine.sock"
    regular.write_text("")
    broken = check_hook_socket(str(regular), daemon_answers=False)
    assert broken.status == "fail" and "not a socket" in broken.detail and broken.fix
    regular.unlink()
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(regular))  # bound, never listening: what a dead agent leaves
        os.chmod(regular, 0o660)
        stale = check_hook_socket(str(regular), daemon_answers=True)
        assert stale.status == "warn" and "stale" in stale.detail
        bound.listen()
        live = check_hook_socket(str(regular), daemon_answers=True)
    assert live.status == "ok"
    assert "mode 0660" in live.detail and "listening" in live.detail
    assert stat.S_ISSOCK(os.stat(regular).st_mode)


def test_a_procfs_that_is_no_procfs_is_a_failed_check(tmp_path: Path) -> None:
    assert check_procfs("/proc").status == "ok"
    hostname = tmp_path / "hostname"
    hostname.write_text("node\n")
    cases = {
        "/nonexistent": "/nonexistent does not exist",
        str(hostname): "is not a directory",
        str(tmp_path): "is not a procfs (it has no self/stat)",
    }
    for path, words in cases.items():
        check = check_procfs(path)
        assert check.status == "fail", check
        assert words in check.detail and "`kvwatch run` refuses it" in check.detail
        assert "--path.procfs" in check.fix


def test_doctor_with_a_missing_procfs_fails_that_check_and_still_reports(tmp_path: Path) -> None:
    code, checks = checks_of(
        "--path.procfs",
        "/nonexistent",
        "--url",
        f"http://127.0.0.1:{free_port()}",
        "--hook-socket",
        str(tmp_path / "engine.sock"),
    )
    assert code == 3
    assert checks["procfs"]["status"] == "fail"
    assert checks["privileges"]["status"] in ("ok", "fail")  # read from this process's /proc
    assert "tcp_wmem" in checks


def test_a_server_that_is_not_an_agent_is_a_warning_naming_it() -> None:
    with garbage_server() as (url, answer):
        answer.content_type, answer.body = "text/html", b"<html></html>"
        health, error = fetch_health(url)
        assert health is None
        check = check_daemon(url, health, error)
        assert check.status == "warn"
        assert f"{url}/healthz is not JSON" in check.detail
        answer.content_type, answer.body = "application/json", b'{"engines": 5}'
        health, error = fetch_health(url)
        assert check_engines(health).status == "info"
