"""Runs the in-guest test module on a kernel: inside a virtme-ng VM, or directly on the host.

virtme-ng boots the kernel over the host's root filesystem (9p, read-only), so the project's
virtualenv and compiled BPF object are visible in the guest as they are here; only the
results directory is shared writable (`--rwdir`). Hardware virtualisation (KVM) is used when
the CPU offers it (vmx/svm) and /dev/kvm is usable; otherwise qemu emulates the CPU (TCG),
which is ~30x slower but needs nothing from the host's hypervisor.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvwatch.collect.bpf.bcc import HEADERS_ENV
from scripts.kernel_matrix.kernels import KernelTree

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
GUEST_MODULES = ("tests/kernel/guest_modes.py", "tests/kernel/guest_bcc.py")
# The guest mounts tmpfs over /var/cache, where the host keeps them: they are shared here.
GUEST_HEADERS = "/tmp/kvwatch-headers"
ACCEL_ENV = "KVWATCH_MATRIX_ACCEL"
GUEST_CPUS = 1  # one host core at most under TCG: the suite runs beside it (make test, -n)
GUEST_MEMORY = "2G"
# Host binaries virtme-ng needs, and the Debian package (or pip package) that provides each.
TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "busybox": "busybox-static",
    "depmod": "kmod",
    "udevadm": "udev",
    "vng": "virtme-ng (pip, in the project's virtualenv)",
}
# pytest inside the guest: no plugin auto-loading (hypothesis alone costs ~30 s emulated),
# no cache writes (the root filesystem is read-only there).
PYTEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
# Settings forwarded into the guest when set here (e.g. the matrix over another BPF object).
FORWARDED_ENV = ("KVWATCH_BPF_OBJECT",)


@dataclass(frozen=True)
class Run:
    """One run of the test module: its exit status, console output and wall time."""

    returncode: int
    output: str
    seconds: float
    timed_out: bool


def tool_path() -> str:
    return os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def missing_tools() -> list[str]:
    """'binary (package)' for every host tool virtme-ng needs that is not installed."""
    path = tool_path()
    return [
        f"{tool} ({package})"
        for tool, package in TOOLS.items()
        if not shutil.which(tool, path=path)
    ]


def accelerator() -> str:
    """'kvm' where the CPU offers hardware virtualisation and /dev/kvm is usable, else 'tcg'."""
    forced = os.environ.get(ACCEL_ENV, "")
    if forced in ("kvm", "tcg"):
        return forced
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "tcg"
    flags = {
        word for line in cpuinfo.splitlines() if line.startswith("flags") for word in line.split()
    }
    usable = os.access("/dev/kvm", os.R_OK | os.W_OK)
    return "kvm" if usable and flags & {"vmx", "svm"} else "tcg"


def pytest_command(results_file: Path, test_timeout_seconds: float) -> list[str]:
    """pytest over the guest modules; each test is bounded by `test_timeout_seconds` (the
    run's own budget: BCC's compile alone took over 300 s in an emulated guest under load)."""
    return [
        sys.executable, "-m", "pytest", "-p", "pytest_timeout", "-p", "no:cacheprovider",
        "-o", f"timeout={int(test_timeout_seconds)}",
        "-q", "-rfE", *GUEST_MODULES, "--matrix-results", str(results_file),
    ]  # fmt: skip


def vng_command(tree: KernelTree, results_dir: Path, guest_command: list[str]) -> list[str]:
    accel = ["--disable-kvm"] if accelerator() == "tcg" else []
    headers = ["--rodir", f"{GUEST_HEADERS}={tree.headers}"] if tree.headers else []
    return [
        str(VENV_BIN / "vng"), "--run", str(tree.image), *accel, "--force-9p",
        "--cpus", str(GUEST_CPUS), "--memory", GUEST_MEMORY, "--rwdir", str(results_dir),
        *headers, "--exec", shlex.join(guest_command),
    ]  # fmt: skip


def run(command: list[str], timeout_seconds: float, env: dict[str, str]) -> Run:
    """Runs `command` in its own process group from the repository root; on timeout the whole
    group (vng, qemu) is killed."""
    started = time.monotonic()
    with subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "PATH": tool_path(), **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout_seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            timed_out = True
    return Run(process.returncode, output, time.monotonic() - started, timed_out)


def run_on_host(results_file: Path, timeout_seconds: float) -> Run:
    return run(pytest_command(results_file, timeout_seconds), timeout_seconds, PYTEST_ENV)


def run_in_vm(tree: KernelTree, results_file: Path, timeout_seconds: float) -> Run:
    """Boots `tree`'s kernel and runs the test modules in it; the guest's environment is set on
    its command line (virtme-ng does not pass the host's through)."""
    forwarded = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
    if tree.headers is not None:
        forwarded[HEADERS_ENV] = GUEST_HEADERS
    env_words = ["env", *(f"{key}={value}" for key, value in {**PYTEST_ENV, **forwarded}.items())]
    guest = [*env_words, *pytest_command(results_file, timeout_seconds)]
    return run(vng_command(tree, results_file.parent, guest), timeout_seconds, {})
