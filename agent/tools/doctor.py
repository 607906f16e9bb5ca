"""`kvwatch doctor`'s checks: can this node run the agent, and if not, what to do.

Besides what the BPF collector needs, it reports what shapes the picture the agent gets:
GPUs through NVML (none is a normal, informational state), the engine-hook socket and the
engines connected to it, whether the daemon answers, and the sysctls that decide how much an
engine can queue to a client that stopped reading before its own writes block.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import platform
import pwd
import socket
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kvwatch.collect.bpf.loader import (
    BTF_PATH,
    SEND_MODES,
    BpfPrograms,
    CollectorSettings,
    object_path,
)
from kvwatch.collect.gpu import GpuInventory
from kvwatch.config.schema import DEFAULT_AGENT_URL, HookConfig
from kvwatch.daemon.preflight import procfs_problem
from kvwatch.errors import KvwatchError, quoted
from kvwatch.tools.baseline import parse_sysctl_numbers, read_sysctl
from kvwatch.tools.client import get_json
from kvwatch.tools.tables import human_bytes

Status = Literal["ok", "warn", "fail", "info"]
CAPABILITIES = {
    "CAP_NET_ADMIN": 12,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_PERFMON": 38,
    "CAP_BPF": 39,
}
TRACEFS_PATHS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
HOOK_SOCKET = HookConfig().socket
HEALTH_TIMEOUT_SECONDS = 2.0
PROBE_TIMEOUT_SECONDS = 0.5
STALE = "; stale: no one listens"
# The kernel's default ceiling for send-buffer autotuning (tcp_wmem[2]): 4 MiB.
DEFAULT_WMEM_MAX_BYTES = 4 << 20
# tcp_notsent_lowat's default: no limit on not-yet-sent bytes beyond the send buffer.
NOTSENT_LOWAT_UNLIMITED = 0xFFFFFFFF


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def parse_effective_capabilities(status_text: str) -> set[str]:
    """Names of the effective capabilities in a /proc/<pid>/status text."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            mask = int(line.split()[1], 16)
            return {name for name, bit in CAPABILITIES.items() if mask >> bit & 1}
    return set()


def check_procfs(procfs_root: str) -> Check:
    """The --path.procfs the agent would be given: `kvwatch run` refuses one that is no procfs
    (it finds each socket's owner there, and acts on no socket without one)."""
    problem = procfs_problem(procfs_root)
    if problem is None:
        return Check("procfs", "ok", procfs_root)
    return Check(
        "procfs",
        "fail",
        f"{quoted(procfs_root)} {problem}: without it no socket has a known owner, so the "
        "agent could never act; `kvwatch run` refuses it",
        "pass --path.procfs where the host's /proc is mounted",
    )


def check_privileges(procfs_root: str) -> Check:
    status_text = Path(procfs_root, "self", "status").read_text()
    held = parse_effective_capabilities(status_text)
    enough = {"CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"} <= held or "CAP_SYS_ADMIN" in held
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    detail = f"{who}; effective: {', '.join(sorted(held)) or 'none'}"
    if enough:
        return Check("privileges", "ok", detail)
    return Check(
        "privileges", "fail", detail, "run as root, or grant CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN"
    )


def check_window_probes(procfs_root: str) -> Check:
    """Whether the agent can have a held stream's socket probe its reader's window
    (kvwatch.collect.window_probe: pidfd_getfd needs CAP_SYS_PTRACE over the socket's owner)."""
    status_text = Path(procfs_root, "self", "status").read_text()
    if "CAP_SYS_PTRACE" in parse_effective_capabilities(status_text):
        return Check("window probes", "ok", "CAP_SYS_PTRACE: held streams' readers are probed")
    return Check(
        "window probes",
        "warn",
        "no CAP_SYS_PTRACE: a paused stream whose reader drains less than half its window is "
        "released only once more data flows",
        "grant CAP_SYS_PTRACE (the systemd unit and the DaemonSet do)",
    )


def check_btf() -> Check:
    if BTF_PATH.exists():
        return Check("kernel BTF", "ok", str(BTF_PATH))
    return Check(
        "kernel BTF",
        "warn",
        f"{BTF_PATH} is missing: the prebuilt CO-RE object cannot load here",
        "use the BCC backend (kernel headers + BCC, see the BCC line), a kernel built with "
        "CONFIG_DEBUG_INFO_BTF=y, or --backend diag",
    )


def check_bcc(btf_present: bool) -> list[Check]:
    """BCC's availability; without BTF, also whether it compiles and attaches kvwatch here."""
    from kvwatch.collect.bpf.bcc import BccPrograms, bcc_status

    status = bcc_status()
    if not status.usable:
        if btf_present:
            return [Check("BCC", "info", f"{status.problem} (not needed: the kernel has BTF)")]
        return [Check("BCC", "fail", status.problem or "", f"{status.hint}; or --backend diag")]
    found = f"Python package at {status.module}, kernel headers at {status.headers}"
    if btf_present:
        return [Check("BCC", "ok", f"{found}; auto uses CO-RE (the kernel has BTF)")]
    checks = [Check("BCC", "ok", f"{found}; auto uses BCC (the kernel has no BTF)")]
    try:
        with BccPrograms(CollectorSettings(max_sockets=64)) as programs:
            described = programs.report.describe()
    except KvwatchError as exc:
        checks.append(Check("BCC programs", "fail", exc.message, exc.hint))
    else:
        checks.append(Check("BCC programs", "ok", f"compiled and attached: {described}"))
    return checks


def check_tracefs() -> Check:
    mounted = [str(p) for p in TRACEFS_PATHS if (p / "events").is_dir()]
    if mounted:
        return Check("tracefs", "ok", f"mounted at {mounted[0]}")
    return Check(
        "tracefs",
        "info",
        "not mounted; raw tracepoints, fentry and kprobes (perf kprobe PMU) do not need it",
        "mount -t tracefs nodev /sys/kernel/tracing only for legacy kprobes on old kernels",
    )


def check_libbpf() -> Check:
    from kvwatch.collect.bpf.libbpf import libbpf

    try:
        return Check("libbpf", "ok", f"version {libbpf().version}")
    except KvwatchError as exc:
        return Check("libbpf", "fail", exc.message, exc.hint)


def check_bpf_object() -> Check:
    try:
        return Check("BPF object", "ok", str(object_path()))
    except KvwatchError as exc:
        return Check("BPF object", "fail", exc.message, exc.hint)


def check_send_modes() -> list[Check]:
    """Tries each send-path mode for real; reports what the others got with the best one."""
    checks: list[Check] = []
    best: BpfPrograms | None = None
    for mode in SEND_MODES:
        try:
            programs = BpfPrograms(CollectorSettings(send_mode=mode, max_sockets=64))
        except KvwatchError as exc:
            checks.append(Check(f"send attach point: {mode}", "info", exc.message))
            continue
        checks.append(
            Check(
                f"send attach point: {mode}",
                "ok",
                "loads and attaches on "
                + ("tcp_sendmsg" if mode in ("fentry", "kprobe") else "sock:sock_send_length"),
            )
        )
        if best is None:
            best = programs
        else:
            programs.close()
    if best is None:
        checks.append(
            Check(
                "send attach point",
                "fail",
                "no mode attaches on this kernel",
                "see the lines above; --backend diag still works without BPF",
            )
        )
        return checks
    with best:
        checks.append(
            Check("send attach point (auto)", "ok", f"auto picks {best.report.send_mode}")
        )
        for point, mode in best.report.points.items():
            if point == "send":
                continue
            status: Status = "ok" if mode != "unavailable" else "info"
            note = "" if mode != "unavailable" else " (needs fentry or kprobe; probes uncounted)"
            checks.append(Check(f"{point} attach point", status, f"{mode}{note}"))
    return checks


def check_gpus(inventory: GpuInventory) -> list[Check]:
    """NVML and one line per GPU; no NVML is an `info` line: kvwatch works without GPUs."""
    if not inventory.available:
        note = "; kvwatch runs without it (streams show KV blocks, no per-GPU memory)"
        return [Check("NVML", "info", inventory.reason + note)]
    snapshot = inventory.snapshot()
    count = len(snapshot.devices)
    driver = f"driver {inventory.driver_version}, {count} GPU(s)"
    checks = [Check("NVML", "ok" if count else "info", driver)]
    for device in snapshot.devices:
        used, total = device.memory_used_bytes, device.memory_total_bytes
        checks.append(
            Check(
                f"GPU {device.index}",
                "ok",
                f"{device.name}: HBM {human_bytes(used)} of {human_bytes(total)} used, "
                f"{len(device.processes)} compute process(es)",
            )
        )
    checks.extend(
        Check("GPU read", "warn", error, "see `nvidia-smi -q`; the other GPUs are still read")
        for error in snapshot.errors
    )
    return checks


def judge_tcp_wmem(value: str) -> Check:
    name = "tcp_wmem"
    _, default, maximum = parse_sysctl_numbers(value)
    queue = (
        f"{value}: a socket's send buffer autotunes from {human_bytes(default)} up to "
        f"{human_bytes(maximum)}, so an engine can queue that much to a client that stopped "
        "reading before its send() blocks"
    )
    if maximum <= DEFAULT_WMEM_MAX_BYTES:
        return Check(name, "ok", queue)
    return Check(
        name,
        "warn",
        queue + ": above the kernel's 4 MiB default, this hides stalls from the engine's own "
        "backpressure for longer (tens of thousands of token events); kvwatch still sees "
        "them in the kernel",
        "set SO_SNDBUF on the engine's client sockets, or lower tcp_wmem's max on a canary "
        "(record `kvwatch baseline save` first, so `baseline diff` can print the rollback)",
    )


def judge_tcp_notsent_lowat(value: str) -> Check:
    name = "tcp_notsent_lowat"
    (limit,) = parse_sysctl_numbers(value)
    if limit >= NOTSENT_LOWAT_UNLIMITED:
        return Check(
            name,
            "info",
            f"{value} (unlimited, the default): unsent bytes are bounded only by the send "
            "buffer; a lower value (e.g. 131072) makes a socket unwritable while more than that "
            "is unsent, so an async engine's drain() blocks soon after its client stops reading",
        )
    return Check(
        name,
        "ok",
        f"{value}: a socket stops being writable while more than {human_bytes(limit)} is "
        "unsent, so an engine feels a stopped client within that much",
    )


def judge_tcp_rmem(value: str) -> Check:
    _, default, maximum = parse_sysctl_numbers(value)
    return Check(
        "tcp_rmem",
        "info",
        f"{value}: receive buffers autotune from {human_bytes(default)} up to "
        f"{human_bytes(maximum)}: how much a reader on this node (a local proxy, a client) "
        "absorbs before its window closes",
    )


def judge_tcp_moderate_rcvbuf(value: str) -> Check:
    on = value.strip() == "1"
    detail = (
        "1: receive autotuning on (a socket that sets SO_RCVBUF opts out)"
        if on
        else f"{value}: receive autotuning off: sockets keep tcp_rmem's default size"
    )
    return Check("tcp_moderate_rcvbuf", "info", detail)


SYSCTL_JUDGES = {
    "net.ipv4.tcp_wmem": judge_tcp_wmem,
    "net.ipv4.tcp_notsent_lowat": judge_tcp_notsent_lowat,
    "net.ipv4.tcp_rmem": judge_tcp_rmem,
    "net.ipv4.tcp_moderate_rcvbuf": judge_tcp_moderate_rcvbuf,
}


def judge_sysctl(name: str, value: str | None) -> Check:
    """The check for one backpressure sysctl from its text (None: this kernel lacks it)."""
    short = name.rpartition(".")[2]
    if value is None:
        return Check(short, "info", "not present in this kernel or network namespace")
    try:
        return SYSCTL_JUDGES[name](value)
    except ValueError:
        return Check(short, "warn", f"unexpected value {value!r}", "check the kernel")


def check_sysctls(procfs_root: str) -> list[Check]:
    return [judge_sysctl(name, read_sysctl(procfs_root, name)) for name in SYSCTL_JUDGES]


def who_can_connect(mode: int, owner: str, group: str) -> str:
    """Who the file mode lets connect to a unix socket (connecting needs write permission)."""
    if mode & stat.S_IWOTH:
        return "any local user"
    allowed = ["root"] + ([f"user {owner}"] if mode & stat.S_IWUSR and owner != "root" else [])
    if mode & stat.S_IWGRP:
        allowed.append(f"members of group {group}")
    return " and ".join(allowed)


def _owner_names(info: os.stat_result) -> tuple[str, str]:
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(info.st_uid).pw_name, grp.getgrgid(info.st_gid).gr_name
    return str(info.st_uid), str(info.st_gid)


def probe_listener(path: str) -> str:
    """How a connection attempt goes: "; listening", "; stale: no one listens", or what
    stopped this user from trying."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_SECONDS)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return STALE
            return f"; this user cannot connect to it ({exc.strerror or exc})"
    return "; listening"


def check_hook_socket(path: str, daemon_answers: bool) -> Check:
    name = "engine hook socket"
    start = "start the agent (`kvwatch run`); it creates the socket, engines connect to it"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        status: Status = "warn" if daemon_answers else "info"
        fix = "pass the agent's --hook-socket path here" if daemon_answers else start
        return Check(name, status, f"{path} does not exist", fix)
    except OSError as exc:
        return Check(name, "warn", f"{path}: {exc.strerror}", "run kvwatch doctor as root")
    if not stat.S_ISSOCK(info.st_mode):
        return Check(
            name,
            "fail",
            f"{path} exists but is not a socket; the agent will not replace it",
            "remove it, or give the agent and the engines another path (--hook-socket)",
        )
    mode = stat.S_IMODE(info.st_mode)
    owner, group = _owner_names(info)
    detail = (
        f"{path}: mode {mode:04o}, {owner}:{group}; {who_can_connect(mode, owner, group)} "
        "can connect, and the agent accepts only uids on hook.allowed_uids (and root)"
    )
    probed = probe_listener(path)
    if probed == STALE:
        return Check(name, "warn" if daemon_answers else "info", detail + probed, start)
    return Check(name, "ok", detail + probed)


def fetch_health(url: str) -> tuple[dict[str, Any] | None, str]:
    """The daemon's /healthz answer, or None and why not."""
    try:
        health: dict[str, Any] = get_json(url, "/healthz", HEALTH_TIMEOUT_SECONDS, dict)
    except KvwatchError as exc:
        return None, exc.message
    return health, ""


def check_daemon(url: str, health: dict[str, Any] | None, error: str) -> Check:
    if health is None:
        return Check(
            "daemon",
            "warn",
            f"no kvwatch agent answers at {url}/healthz ({error})",
            "start the agent: `kvwatch run` (or `systemctl start kvwatch`); "
            "pass --url when it listens elsewhere",
        )
    return Check(
        "daemon",
        "ok",
        f"answers at {url}: mode {health.get('mode')}, collector {health.get('backend')}, "
        f"up {health.get('uptime_seconds')} s",
    )


def check_socket_table(health: dict[str, Any] | None) -> Check:
    table = health.get("socket_table") if health is not None else None
    if not isinstance(table, dict):
        return Check("socket table", "info", "unknown: the daemon does not answer or has no BPF")
    detail = (
        f"{table.get('tracked')} of {table.get('max_sockets')} records in use, "
        f"{table.get('evictions')} evicted"
    )
    if not table.get("full"):
        return Check("socket table", "ok", detail)
    return Check(
        "socket table",
        "warn",
        f"full: {detail}; {table.get('sockets_seen')} sockets watched, so the agent sweeps "
        "with sock_diag for the stalls the table has no room for (slower, coarser)",
        f"raise --max-sockets (collector.max_sockets) to at least {table.get('needed_sockets')}",
    )


def check_engines(health: dict[str, Any] | None) -> Check:
    if health is None:
        return Check("engines", "info", "unknown: the daemon does not answer")
    listed = health.get("engines")
    engines = [e for e in listed if isinstance(e, dict)] if isinstance(listed, list) else []
    if not engines:
        return Check(
            "engines",
            "info",
            "no engine is connected to the hook socket: stalls are seen, but no request or "
            "KV is joined and nothing can be cancelled (start engines with the kvwatch hook, "
            "e.g. `kvwatch engine --kvwatch-socket PATH`)",
        )
    described = "; ".join(
        f"{e.get('engine')} pid {e.get('pid')} uid {e.get('uid')} ({e.get('model')} on "
        f"{e.get('device')}, {e.get('kv_blocks_total')} KV blocks, {e.get('streams')} stream(s))"
        for e in engines
    )
    return Check("engines", "ok", f"{len(engines)} connected: {described}")


def run_checks(
    procfs_root: str = "/proc", url: str = DEFAULT_AGENT_URL, hook_socket: str = HOOK_SOCKET
) -> list[Check]:
    procfs = check_procfs(procfs_root)
    readable_procfs = procfs_root if procfs.status == "ok" else "/proc"  # for what follows
    checks = [
        Check("kernel", "info", f"{platform.release()} ({platform.machine()})"),
        check_privileges(readable_procfs),
        check_window_probes(readable_procfs),
        check_btf(),
        check_tracefs(),
        check_libbpf(),
        check_bpf_object(),
    ]
    btf_present = BTF_PATH.exists()
    if btf_present and all(c.status != "fail" for c in checks):
        checks.extend(check_send_modes())
    checks.extend(check_bcc(btf_present))
    inventory = GpuInventory()
    try:
        checks.extend(check_gpus(inventory))
    finally:
        inventory.close()
    checks.append(procfs)
    checks.extend(check_sysctls(readable_procfs))
    health, error = fetch_health(url)
    checks.append(check_daemon(url, health, error))
    checks.append(check_socket_table(health))
    checks.append(check_hook_socket(hook_socket, health is not None))
    checks.append(check_engines(health))
    return checks


def node_can_run_agent(checks: list[Check]) -> bool:
    return all(check.status != "fail" for check in checks)


def checks_json(checks: list[Check]) -> dict[str, object]:
    return {"ok": node_can_run_agent(checks), "checks": [asdict(c) for c in checks]}
