"""`kvwatch baseline`: the TCP settings, counters and engine memory that shape backpressure,
captured before a change so its effect can be read afterwards (and the change rolled back).

A snapshot holds the sysctls of SYSCTLS as the kernel prints them, the counters of COUNTERS
(named as `nstat` names them: table prefix + field), /proc/net/sockstat, and the cgroup memory
of chosen processes (cgroup v2 `memory.current`/`memory.stat`, v1 `memory.usage_in_bytes`
as a fallback). Parsers take text and are tested on fixtures; readers take the host paths
from options (--path.procfs, --path.sysfs). `kvwatch doctor` reads its sysctls through here.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvwatch.collect.procfs import Procfs
from kvwatch.errors import ConfigError

FORMAT = "kvwatch-baseline"
FORMAT_VERSION = 1
SYSCTLS = (
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
    "net.ipv4.tcp_mem",
    "net.ipv4.tcp_moderate_rcvbuf",
    "net.ipv4.tcp_notsent_lowat",
    "net.core.rmem_max",
    "net.core.wmem_max",
)
# Outgoing segments and retransmits (/proc/net/snmp), then TcpExt (/proc/net/netstat):
# timeouts, aborts after too many retries or probes, receive-queue drops, socket-memory
# pressure (entries, and milliseconds spent in it), zero-window adverts and window probes.
COUNTERS = (
    "TcpOutSegs",
    "TcpRetransSegs",
    "TcpExtTCPTimeouts",
    "TcpExtTCPAbortOnTimeout",
    "TcpExtTCPRcvQDrop",
    "TcpExtTCPMemoryPressures",
    "TcpExtTCPMemoryPressuresChrono",
    "TcpExtTCPToZeroWindowAdv",
    "TcpExtTCPFromZeroWindowAdv",
    "TcpExtTCPWantZeroWindowAdv",
    "TcpExtTCPWinProbe",
)
# Where a cgroup v2 hierarchy is mounted under sysfs: pure v2, then the hybrid layout.
CGROUP2_MOUNTS = ("fs/cgroup", "fs/cgroup/unified")
CGROUP1_MEMORY_MOUNT = "fs/cgroup/memory"
_PID_HINT = "pass the pid of a running engine process (--pid), or its name (--process)"


def parse_sysctl_value(text: str) -> str:
    """A sysctl as /proc/sys prints it, with its tab-separated fields joined by one space."""
    return " ".join(text.split())


def parse_sysctl_numbers(text: str) -> tuple[int, ...]:
    """The integers of a sysctl value ("4096 16384 4194304" -> (4096, 16384, 4194304))."""
    try:
        return tuple(int(word) for word in text.split())
    except ValueError as exc:
        raise ValueError(f"not a numeric sysctl value: {text!r}") from exc


def sysctl_path(procfs_root: str, name: str) -> Path:
    return Path(procfs_root, "sys", *name.split("."))


def read_sysctl(procfs_root: str, name: str) -> str | None:
    """The value of sysctl `name`, None where this kernel (or network namespace) lacks it."""
    try:
        return parse_sysctl_value(sysctl_path(procfs_root, name).read_text())
    except (FileNotFoundError, PermissionError):
        return None


def parse_nstat_tables(text: str) -> dict[str, int]:
    """Counters of /proc/net/netstat or /proc/net/snmp, named as nstat names them.

    Both files pair a header line ("TcpExt: SyncookiesSent ...") with a value line of the same
    prefix; lines that do not pair up are skipped."""
    counters: dict[str, int] = {}
    lines = text.splitlines()
    for header, values in zip(lines[::2], lines[1::2], strict=False):
        prefix, _, names = header.partition(":")
        value_prefix, _, numbers = values.partition(":")
        if prefix != value_prefix or not prefix:
            continue
        for name, number in zip(names.split(), numbers.split(), strict=False):
            try:
                counters[prefix + name] = int(number)
            except ValueError:
                continue
    return counters


def parse_sockstat(text: str) -> dict[str, dict[str, int]]:
    """/proc/net/sockstat as {protocol: {field: value}} ("TCP: inuse 3 ... mem 2" -> TCP)."""
    table: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        protocol, _, rest = line.partition(":")
        words = rest.split()
        if not protocol or len(words) % 2:
            continue
        try:
            table[protocol] = {
                key: int(value) for key, value in zip(words[::2], words[1::2], strict=True)
            }
        except ValueError:
            continue
    return table


@dataclass(frozen=True)
class CgroupPaths:
    """A process's cgroup paths: the v2 (unified) one and the v1 memory controller's."""

    v2: str | None
    v1_memory: str | None


def parse_cgroup_paths(text: str) -> CgroupPaths:
    """The v2 line (`0::path`) and the v1 memory line (`N:...memory...:path`) of
    /proc/<pid>/cgroup."""
    v2: str | None = None
    v1_memory: str | None = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1_memory = path
    return CgroupPaths(v2, v1_memory)


def parse_memory_stat(text: str) -> dict[str, int]:
    """memory.stat ("anon 123\\nfile 456 ...") as a dict; malformed lines are skipped."""
    stat: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key and value.strip().lstrip("-").isdigit():
            stat[key] = int(value)
    return stat


def parse_cmdline(raw: bytes) -> list[str]:
    """/proc/<pid>/cmdline: NUL-separated arguments."""
    return [arg.decode("utf-8", "replace") for arg in raw.split(b"\0") if arg]


@dataclass(frozen=True)
class ProcessMemory:
    """One process's cgroup memory. `socket_memory_bytes` is the TCP/socket memory charged to
    the cgroup (v2: memory.stat `sock`; v1: memory.kmem.tcp.usage_in_bytes); None where the
    kernel does not say. `cgroup_version` is None when no memory controller was readable."""

    pid: int
    comm: str
    cgroup: str
    cgroup_version: int | None
    memory_current_bytes: int | None
    socket_memory_bytes: int | None
    memory_stat: dict[str, int] = field(default_factory=dict)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, PermissionError, ValueError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, PermissionError):
        return ""


def cgroup_memory(sysfs_root: str, pid: int, comm: str, paths: CgroupPaths) -> ProcessMemory:
    """Reads the memory of the cgroup at `paths`: v2 where its memory controller is enabled,
    else v1's memory controller, else nothing (cgroup_version None)."""
    if paths.v2 is not None:
        for mount in CGROUP2_MOUNTS:
            directory = Path(sysfs_root, mount, paths.v2.lstrip("/"))
            current = _read_int(directory / "memory.current")
            if current is not None:
                stat = parse_memory_stat(_read_text(directory / "memory.stat"))
                return ProcessMemory(pid, comm, paths.v2, 2, current, stat.get("sock"), stat)
    if paths.v1_memory is not None:
        directory = Path(sysfs_root, CGROUP1_MEMORY_MOUNT, paths.v1_memory.lstrip("/"))
        current = _read_int(directory / "memory.usage_in_bytes")
        if current is not None:
            stat = parse_memory_stat(_read_text(directory / "memory.stat"))
            tcp = _read_int(directory / "memory.kmem.tcp.usage_in_bytes")
            return ProcessMemory(pid, comm, paths.v1_memory, 1, current, tcp, stat)
    return ProcessMemory(pid, comm, paths.v2 or paths.v1_memory or "", None, None, None)


def matches_name(name: str, comm: str, cmdline: list[str]) -> bool:
    """A process is `name` when its comm is, or the file name of one of its first three
    arguments is (so `python -m vllm.entrypoints...` is not `vllm`, but `vllm serve` is)."""
    return comm == name or any(Path(arg).name == name for arg in cmdline[:3])


def pids_named(procfs_root: str, names: Iterable[str]) -> dict[str, list[int]]:
    """The pids matching each name (this process excluded: its own arguments name them)."""
    wanted: dict[str, list[int]] = {name: [] for name in names}
    if not wanted:
        return wanted
    procfs = Procfs(procfs_root)
    for pid in sorted(procfs.pids()):
        comm = procfs.comm(pid)
        if comm is None or pid == os.getpid():
            continue
        try:
            cmdline = parse_cmdline(Path(procfs_root, str(pid), "cmdline").read_bytes())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for name, found in wanted.items():
            if matches_name(name, comm, cmdline):
                found.append(pid)
    return wanted


def process_memory(procfs_root: str, sysfs_root: str, pid: int) -> ProcessMemory:
    procfs = Procfs(procfs_root)
    comm = procfs.comm(pid)
    cgroup_text = _read_text(Path(procfs_root, str(pid), "cgroup"))
    if comm is None or not cgroup_text:
        raise ConfigError(f"process {pid} does not exist (or hides its cgroup)", _PID_HINT)
    return cgroup_memory(sysfs_root, pid, comm, parse_cgroup_paths(cgroup_text))


@dataclass(frozen=True)
class Snapshot:
    """One baseline. `taken_unix_seconds` orders snapshots and sets the interval counters are
    divided by; counters of snapshots with different `boot_id`s are not comparable."""

    taken_at: str
    taken_unix_seconds: float
    hostname: str
    kernel: str
    boot_id: str
    sysctls: dict[str, str | None]
    counters: dict[str, int | None]
    sockstat: dict[str, dict[str, int]]
    processes: tuple[ProcessMemory, ...]


def read_counters(procfs_root: str) -> dict[str, int | None]:
    found: dict[str, int] = {}
    for table in ("snmp", "netstat"):
        found.update(parse_nstat_tables(_read_text(Path(procfs_root, "net", table))))
    return {name: found.get(name) for name in COUNTERS}


def take_snapshot(
    procfs_root: str = "/proc",
    sysfs_root: str = "/sys",
    pids: Iterable[int] = (),
    names: Iterable[str] = (),
) -> tuple[Snapshot, list[str]]:
    """A snapshot now, and warnings for the operator (a name that matched no process)."""
    warnings: list[str] = []
    chosen = list(dict.fromkeys(pids))
    for name, found in pids_named(procfs_root, names).items():
        if not found:
            warnings.append(f"no running process is named {name!r}; its memory is not recorded")
        chosen.extend(pid for pid in found if pid not in chosen)
    processes = tuple(process_memory(procfs_root, sysfs_root, pid) for pid in chosen)
    now = time.time()
    snapshot = Snapshot(
        taken_at=datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        taken_unix_seconds=now,
        hostname=socket.gethostname(),
        kernel=platform.release(),
        boot_id=_read_text(Path(procfs_root, "sys", "kernel", "random", "boot_id")).strip(),
        sysctls={name: read_sysctl(procfs_root, name) for name in SYSCTLS},
        counters=read_counters(procfs_root),
        sockstat=parse_sockstat(_read_text(Path(procfs_root, "net", "sockstat"))),
        processes=processes,
    )
    return snapshot, warnings


def snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    """The file format: a format marker and version, then the snapshot's fields."""
    return {"format": FORMAT, "version": FORMAT_VERSION, **asdict(snapshot)}


def save_snapshot(snapshot: Snapshot, path: str) -> None:
    """Writes the snapshot to `path` atomically (a reader never sees half a file)."""
    partial = f"{path}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(snapshot_json(snapshot), file, indent=2)
            file.write("\n")
        os.replace(partial, path)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the baseline to {path}: {exc.strerror}",
            "pass a path in a writable directory",
        ) from exc
