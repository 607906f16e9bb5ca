"""`kvwatch doctor`'s checks: can this node run the agent, and if not, what to do."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from kvwatch.bpf.loader import SEND_MODES, BpfPrograms, CollectorSettings, object_path
from kvwatch.errors import KvwatchError

Status = Literal["ok", "warn", "fail", "info"]
CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38, "CAP_BPF": 39}
BTF_PATH = Path("/sys/kernel/btf/vmlinux")
TRACEFS_PATHS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


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


def check_btf() -> Check:
    if BTF_PATH.exists():
        return Check("kernel BTF", "ok", str(BTF_PATH))
    return Check(
        "kernel BTF",
        "fail",
        f"{BTF_PATH} is missing",
        "use a kernel built with CONFIG_DEBUG_INFO_BTF=y, or the BCC backend "
        "with kernel headers, or --backend diag",
    )


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
    from kvwatch.bpf.libbpf import libbpf

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
            checks.append(Check(f"send hook: {mode}", "info", exc.message))
            continue
        checks.append(
            Check(
                f"send hook: {mode}",
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
                "send hook",
                "fail",
                "no mode attaches on this kernel",
                "see the lines above; --backend diag still works without BPF",
            )
        )
        return checks
    with best:
        checks.append(Check("send hook (auto)", "ok", f"auto picks {best.report.send_mode}"))
        for hook, mode in best.report.hooks.items():
            if hook == "send":
                continue
            status: Status = "ok" if mode != "unavailable" else "info"
            note = "" if mode != "unavailable" else " (needs fentry or kprobe; probes uncounted)"
            checks.append(Check(f"{hook} hook", status, f"{mode}{note}"))
    return checks


def run_checks(procfs_root: str = "/proc") -> list[Check]:
    checks = [
        Check("kernel", "info", f"{platform.release()} ({platform.machine()})"),
        check_privileges(procfs_root),
        check_btf(),
        check_tracefs(),
        check_libbpf(),
        check_bpf_object(),
    ]
    if all(c.status != "fail" for c in checks):
        checks.extend(check_send_modes())
    return checks


def node_can_run_agent(checks: list[Check]) -> bool:
    return all(check.status != "fail" for check in checks)


def checks_json(checks: list[Check]) -> dict[str, object]:
    return {"ok": node_can_run_agent(checks), "checks": [asdict(c) for c in checks]}
