"""`kvwatch baseline save` / `diff`: on this machine, around a real change made in a network
namespace of our own (so the host's settings are never touched), and on fixture texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.errors import EXIT_USAGE, ConfigError
from kvwatch.tools.baseline import (
    COUNTERS,
    SYSCTLS,
    CgroupPaths,
    Snapshot,
    cgroup_memory,
    parse_cgroup_paths,
    parse_memory_stat,
    parse_nstat_tables,
    parse_sockstat,
    read_sysctl,
    snapshot_json,
)
from kvwatch.tools.baseline_diff import diff_lines, diff_snapshots, load_snapshot
from tests.tools.conftest import kvwatch

SNMP = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1000
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens OutSegs RetransSegs
Tcp: 1 200 120000 -1 40 5000 12
"""
NETSTAT = """\
TcpExt: SyncookiesSent TCPTimeouts TCPRcvQDrop TCPToZeroWindowAdv TCPWinProbe
TcpExt: 0 3 0 17 9
IpExt: InNoRoutes InOctets
IpExt: 0 123456
"""
SOCKSTAT = """\
sockets: used 41
TCP: inuse 5 orphan 0 tw 64 alloc 6 mem 3
UDP: inuse 0 mem 0
"""
CGROUP_V2 = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n"
CGROUP_HYBRID = "12:memory:/engine\n4:cpu,cpuacct:/engine\n1:name=systemd:/x\n0::/x\n"
# Runs inside `unshare --net`: lo up, baseline A, a harmless change (this namespace's own
# sysctls, gone with it), a stalled loopback client, baseline B, then the diff in there too.
NETNS_SESSION = """
import subprocess, sys, time
from pathlib import Path
from kvwatch.lab.harness.scenario import Scenario
a, b = sys.argv[1:3]
kvwatch = [sys.executable, "-m", "kvwatch.cli", "baseline"]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run([*kvwatch, "save", a, "--pid", str(os.getpid())], check=True)
Path("/proc/sys/net/ipv4/tcp_wmem").write_text("4096 16384 8388608")
Path("/proc/sys/net/ipv4/tcp_notsent_lowat").write_text("131072")
with Scenario() as scenario:
    scenario.connect("stalled")
    time.sleep(1.0)
subprocess.run([*kvwatch, "save", b, "--pid", str(os.getpid())], check=True)
diff = subprocess.run([*kvwatch, "diff", a, b], check=True, capture_output=True, text=True)
print(diff.stdout)
print("tcp_wmem after diff:", Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split())
"""


def test_save_on_this_machine(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        path = tmp_path / "now.json"
        result = kvwatch(
            "baseline", "save", str(path), "--pid", str(os.getpid()), "--process", "sleep"
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert result.returncode == 0, result.stderr
    saved = json.loads(path.read_text())
    assert (saved["format"], saved["version"]) == ("kvwatch-baseline", 1)
    assert saved["sysctls"] == {name: read_sysctl("/proc", name) for name in SYSCTLS}
    assert list(saved["counters"]) == list(COUNTERS)
    assert isinstance(saved["counters"]["TcpRetransSegs"], int)
    assert "inuse" in saved["sockstat"]["TCP"]
    processes = {p["pid"]: p for p in saved["processes"]}
    assert processes.keys() >= {os.getpid(), sleeper.pid}
    ours = processes[os.getpid()]
    assert ours["cgroup_version"] in (1, 2)
    assert ours["memory_current_bytes"] > 0


def test_diff_around_a_change_in_our_own_network_namespace(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    session = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", "import os\n" + NETNS_SESSION, str(a), str(b)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert session.returncode == 0, session.stderr
    text = session.stdout
    assert "tcp_wmem after diff: ['4096', '16384', '8388608']" in text  # printed, not run
    assert "sysctl -w 'net.ipv4.tcp_wmem=4096 16384 4194304'" in text
    assert "sysctl -w net.ipv4.tcp_notsent_lowat=4294967295" in text
    assert "printed only" in text
    result = kvwatch("baseline", "diff", str(a), str(b), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    changed = {s["name"] for s in report["sysctls"] if s["changed"]}
    assert changed == {"net.ipv4.tcp_wmem", "net.ipv4.tcp_notsent_lowat"}
    assert len(report["rollback"]) == 2
    counters = {c["name"]: c for c in report["counters"]}
    adverts = counters["TcpExtTCPToZeroWindowAdv"]
    assert adverts["delta"] >= 1, "the stalled client advertised a zero window"
    assert adverts["per_second"] == pytest.approx(
        adverts["delta"] / report["interval_seconds"], rel=1e-3
    )
    assert counters["TcpExtTCPWinProbe"]["delta"] >= 1
    (process,) = report["processes"]
    assert process["memory_bytes"]["a"] > 0


def snapshot(at: float, boot: str = "boot-1", **changes: object) -> Snapshot:
    fields: dict[str, object] = {
        "taken_at": f"t{at}",
        "taken_unix_seconds": at,
        "hostname": "node-1",
        "kernel": "6.8.0",
        "boot_id": boot,
        "sysctls": {"net.ipv4.tcp_wmem": "4096 16384 4194304", "net.core.wmem_max": "212992"},
        "counters": {name: parse_nstat_tables(SNMP + NETSTAT).get(name) for name in COUNTERS},
        "sockstat": parse_sockstat(SOCKSTAT),
        "processes": (),
        **changes,
    }
    return Snapshot(**fields)  # type: ignore[arg-type]


def test_parsers_on_fixture_texts(tmp_path: Path) -> None:
    counters = parse_nstat_tables(SNMP + NETSTAT)
    assert counters["TcpRetransSegs"] == 12
    assert counters["TcpMaxConn"] == -1
    assert counters["TcpExtTCPToZeroWindowAdv"] == 17
    assert counters["IpExtInOctets"] == 123456
    assert parse_sockstat(SOCKSTAT)["TCP"] == {
        "inuse": 5,
        "orphan": 0,
        "tw": 64,
        "alloc": 6,
        "mem": 3,
    }
    assert parse_cgroup_paths(CGROUP_V2) == CgroupPaths(CGROUP_V2[3:].strip(), None)
    assert parse_cgroup_paths(CGROUP_HYBRID) == CgroupPaths("/x", "/engine")
    assert parse_memory_stat("anon 10\nsock 4096\nbroken\n") == {"anon": 10, "sock": 4096}
    v2 = tmp_path / "fs" / "cgroup" / "kubepods.slice"
    v2.mkdir(parents=True)
    (v2 / "memory.current").write_text("1048576\n")
    (v2 / "memory.stat").write_text("anon 524288\nsock 8192\n")
    found = cgroup_memory(str(tmp_path), 7, "engine", CgroupPaths("/kubepods.slice", "/engine"))
    assert (found.cgroup_version, found.memory_current_bytes) == (2, 1048576)
    assert found.socket_memory_bytes == 8192
    v1 = tmp_path / "fs" / "cgroup" / "memory" / "engine"
    v1.mkdir(parents=True)
    (v1 / "memory.usage_in_bytes").write_text("2048\n")
    (v1 / "memory.kmem.tcp.usage_in_bytes").write_text("512\n")
    older = cgroup_memory(str(tmp_path), 7, "engine", CgroupPaths("/", "/engine"))
    assert (older.cgroup_version, older.memory_current_bytes, older.socket_memory_bytes) == (
        1,
        2048,
        512,
    )
    none = cgroup_memory(str(tmp_path), 7, "engine", CgroupPaths(None, None))
    assert none.cgroup_version is None and none.memory_current_bytes is None


def test_diff_of_fixture_snapshots_rates_rollback_and_notes() -> None:
    a = snapshot(1000.0)
    later = dict(a.counters, TcpRetransSegs=72, TcpExtTCPTimeouts=1)
    b = snapshot(1060.0, counters=later, sysctls={"net.ipv4.tcp_wmem": "4096 16384 8388608"})
    diff = diff_snapshots(a, b)
    counters = {c.name: c for c in diff.counters}
    assert (counters["TcpRetransSegs"].delta, counters["TcpRetransSegs"].per_second) == (60, 1.0)
    assert counters["TcpExtTCPTimeouts"].per_second is None
    assert any("TcpExtTCPTimeouts went backwards" in note for note in diff.notes)
    assert diff.rollback == ["sysctl -w 'net.ipv4.tcp_wmem=4096 16384 4194304'"]
    assert "net.core.wmem_max is not in B: this kernel (or network namespace) no longer has it" in (
        diff.notes
    )
    text = "\n".join(diff_lines(diff, "a.json", "b.json"))
    assert "60.0 s later" in text and "+60  1/s" in text
    rebooted = diff_snapshots(a, snapshot(1060.0, boot="boot-2", counters=later))
    assert all(c.per_second is None for c in rebooted.counters)
    assert any("rebooted" in note for note in rebooted.notes)


def test_corrupted_and_foreign_files_are_usage_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    whole = json.dumps(snapshot_json(snapshot(1.0)), indent=2)
    good.write_text(whole)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(whole[: len(whole) // 2])
    result = kvwatch("baseline", "diff", str(good), str(truncated))
    assert result.returncode == EXIT_USAGE, result.stderr
    assert f"{truncated} is not a usable kvwatch baseline: invalid JSON at line" in result.stderr
    assert "what to do: take a new one with `kvwatch baseline save FILE`" in result.stderr
    assert "Traceback" not in result.stderr
    damaged = {
        "foreign.json": ('{"hello": 1}', "no 'kvwatch-baseline' format marker"),
        "typed.json": (whole.replace('"counters": {', '"counters": {"X": "7", '), "'counters'"),
        "future.json": (whole.replace('"version": 1', '"version": 99'), "version 99"),
        "binary.json": ("\udcff", "not UTF-8"),
    }
    for name, (content, words) in damaged.items():
        path = tmp_path / name
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(ConfigError, match=words) as caught:
            load_snapshot(str(path))
        assert caught.value.exit_code == EXIT_USAGE and caught.value.hint
    with pytest.raises(ConfigError, match="cannot read baseline"):
        load_snapshot(str(tmp_path / "absent.json"))
    with pytest.raises(ConfigError, match="not taken after") as caught:
        diff_snapshots(snapshot(5.0), snapshot(5.0))
    assert "pass the older baseline first" in caught.value.hint


def test_a_baseline_is_read_only_from_a_small_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = {
        str(fifo): "is a FIFO, not a regular file",
        "/dev/zero": "is a character device, not a regular file",
        str(deep): "it is not a baseline's JSON",
    }
    for path, words in cases.items():
        with pytest.raises(ConfigError, match=words) as caught:
            load_snapshot(path)
        assert caught.value.exit_code == EXIT_USAGE
