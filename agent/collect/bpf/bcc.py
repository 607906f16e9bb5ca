"""The BCC build of kvwatch's programs, for kernels without BTF but with their headers.

BCC compiles `bpf/kvwatch_bcc.c` at start-up with its own clang/LLVM against the running
kernel's headers, so field offsets come from the headers instead of CO-RE relocations. The
programs are the same C text as the CO-RE object (kvwatch_socket.h, kvwatch_handlers.h) and fill
the same maps with the same records and events; `BccPrograms` hands their file descriptors to
`BpfCollector`, which reads them exactly as it reads the CO-RE maps.

Without BTF there are no fentry or tp_btf programs: the send path is a kprobe on
tcp_sendmsg, else the sock_send_length raw tracepoint (Linux 6.3+); the other attach points are
raw tracepoints. BCC is a distribution package, not a PyPI one: `import_bcc` finds it in the
system's Python directories when the virtualenv does not have it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvwatch.collect.bpf.libbpf import check_rc, libbpf
from kvwatch.collect.bpf.loader import (
    PROBE0_PROGRAMS,
    SEND_TRACEPOINT,
    TRACEPOINT_ATTACH_POINTS,
    AttachReport,
    CollectorSettings,
    send_program,
    tracepoint_programs,
)
from kvwatch.collect.bpf.maps import HashTable, SocketTable
from kvwatch.errors import BpfError, ConfigError

log = logging.getLogger(__name__)

BCC_SEND_MODES = ("kprobe", "raw_tp")
BCC_TRACEPOINT_MODE = "raw_tp"
SEND_FUNCTION = "tcp_sendmsg"
PROBE0_FUNCTION = "tcp_send_probe0"
SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCE_FILE = SOURCE_DIR / "kvwatch_bcc.c"
# Where distributions put the `bcc` Python package (python3-bpfcc, python3-bcc).
SYSTEM_PYTHON_DIRS = (
    "/usr/lib/python3/dist-packages",
    f"/usr/lib/python3.{sys.version_info.minor}/site-packages",
    f"/usr/lib64/python3.{sys.version_info.minor}/site-packages",
    "/usr/lib/python3/site-packages",
)
INSTALL_BCC = (
    "install BCC from the distribution: `apt install python3-bpfcc` (Debian, Ubuntu) or "
    "`dnf install python3-bcc` (RHEL, Fedora, Amazon Linux)"
)
HEADERS_ENV = "BCC_KERNEL_SOURCE"
KHEADERS = Path("/sys/kernel/kheaders.tar.xz")


def install_headers_hint(release: str) -> str:
    return (
        f"install the headers of the running kernel: `apt install linux-headers-{release}` "
        f"(Debian, Ubuntu) or `dnf install kernel-devel-{release}` (RHEL, Fedora, Amazon "
        f"Linux); or point {HEADERS_ENV} at a matching header tree"
    )


def _import_from(directory: str) -> ModuleType | None:
    init = Path(directory, "bcc", "__init__.py")
    if not init.is_file():
        return None
    spec = importlib.util.spec_from_file_location(
        "bcc", init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["bcc"]
        raise
    return module


def import_bcc() -> ModuleType:
    """BCC's Python package: from the virtualenv if it has one, else the system's copy alone
    (nothing else from the system's Python directories is put on the path)."""
    if "bcc" in sys.modules:
        return sys.modules["bcc"]
    problems: list[str] = []
    try:
        import bcc  # type: ignore[import-not-found,import-untyped,unused-ignore]

        return bcc  # type: ignore[no-any-return,unused-ignore]
    except ImportError as exc:
        problems.append(str(exc))
    except OSError as exc:  # the package is there but libbcc is not
        raise BpfError(f"BCC's Python package cannot load libbcc: {exc}", INSTALL_BCC) from exc
    for directory in SYSTEM_PYTHON_DIRS:
        try:
            module = _import_from(directory)
        except (ImportError, OSError) as exc:
            problems.append(f"{directory}: {exc}")
            continue
        if module is not None:
            return module
    raise BpfError(
        "BCC is not installed (no `bcc` Python package in the virtualenv or in "
        f"{', '.join(SYSTEM_PYTHON_DIRS)})",
        INSTALL_BCC,
    )


def kernel_headers(release: str | None = None) -> Path | None:
    """The header tree BCC will compile against, found the way BCC looks for it:
    $BCC_KERNEL_SOURCE, then /lib/modules/<release>/build (with its source/ sibling), then the
    kernel's own /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS). None when there is none."""
    release = release or platform.release()
    override = os.environ.get(HEADERS_ENV)
    candidates = [Path(override)] if override else []
    modules = Path("/lib/modules", release)
    candidates += [modules / "source", modules / "build"]
    for tree in candidates:
        if (tree / "include" / "linux" / "kconfig.h").is_file():
            return tree
    return KHEADERS if KHEADERS.is_file() else None


@dataclass(frozen=True)
class BccStatus:
    """Whether the BCC backend can run on this machine, and if not, why and what to do."""

    module: str | None
    headers: Path | None
    problem: str | None
    hint: str

    @property
    def usable(self) -> bool:
        return self.problem is None


def bcc_status() -> BccStatus:
    release = platform.release()
    try:
        module: str | None = str(Path(import_bcc().__file__ or "bcc").parent)
    except BpfError as exc:
        return BccStatus(None, kernel_headers(release), exc.message, exc.hint)
    headers = kernel_headers(release)
    if headers is None:
        return BccStatus(
            module,
            None,
            f"no kernel headers for {release} (looked in ${HEADERS_ENV}, /lib/modules/{release}, "
            f"{KHEADERS})",
            install_headers_hint(release),
        )
    return BccStatus(module, headers, None, "")


def _check_settings(settings: CollectorSettings) -> tuple[str, ...]:
    """The send modes to try, in order; refuses modes that need BTF."""
    if settings.tracepoint_mode not in ("auto", BCC_TRACEPOINT_MODE):
        raise ConfigError(
            f"the BCC backend has no {settings.tracepoint_mode} tracepoints (they need BTF)",
            f"use --backend core for {settings.tracepoint_mode}, or leave the mode on auto",
        )
    if settings.storage == "sk_storage":
        raise ConfigError(
            "the BCC backend keeps records in the LRU hash (socket-local storage needs BTF)",
            "use --backend core for sk_storage, or leave the storage on auto",
        )
    if settings.send_mode == "auto":
        return BCC_SEND_MODES
    if settings.send_mode not in BCC_SEND_MODES:
        raise ConfigError(
            f"the BCC backend has no {settings.send_mode} send mode (it needs BTF)",
            f"use --send-mode {' or '.join(BCC_SEND_MODES)} with --backend bcc, or --backend core",
        )
    return (settings.send_mode,)


class BccPrograms:
    """kvwatch's programs compiled by BCC, loaded and attached; `close()` detaches them.

    Same interface and invariants as `loader.BpfPrograms`: while open, the send, ACK,
    lifecycle and retransmit attach points are attached and the map fds (owned by BCC) are valid.
    """

    def __init__(self, settings: CollectorSettings) -> None:
        settings.validate()
        modes = _check_settings(settings)
        status = bcc_status()
        if not status.usable:
            raise BpfError(f"the BCC backend cannot run: {status.problem}", status.hint)
        self.settings = settings
        self.headers = status.headers
        self.report = AttachReport()
        self._bpf = self._compile(import_bcc(), settings)
        try:
            self.sockets_fd = self._map_fd("kv_sockets")
            self.table: SocketTable = HashTable(self.sockets_fd)
            self.events_fd = self._map_fd("kv_events")
            self.stats_fd = self._map_fd("kv_stats")
            self._write_settings(settings)
            self._attach(modes)
        except BaseException:
            self.close()
            raise
        log.debug("%s", self.report.describe())

    def _compile(self, bcc: ModuleType, settings: CollectorSettings) -> Any:
        if not SOURCE_FILE.is_file():
            raise BpfError(
                f"the BPF sources for BCC are missing: {SOURCE_FILE}",
                "build them with `make bpf`, or reinstall kvwatch",
            )
        cflags = [f"-I{SOURCE_DIR}", f"-DKV_MAX_SOCKETS={settings.max_sockets}"]
        try:
            return bcc.BPF(src_file=str(SOURCE_FILE).encode(), cflags=cflags)
        except Exception as exc:  # BCC raises bare Exception; its compiler wrote to stderr
            raise BpfError(
                f"BCC could not compile kvwatch's programs against {self.headers}: {exc}",
                "the compiler's messages are above; check that the headers match "
                f"`uname -r` ({platform.release()})",
            ) from exc

    def _map_fd(self, name: str) -> int:
        return int(self._bpf[name.encode()].map_fd)

    def _write_settings(self, settings: CollectorSettings) -> None:
        values = settings.kernel_settings()
        key = ctypes.c_uint32(0)
        check_rc(
            libbpf().bpf_map_update_elem(
                self._map_fd("kv_settings"), ctypes.byref(key), ctypes.byref(values), 0
            ),
            "write kv_settings",
        )

    def _attach_one(self, point: str, program: str, mode: str, target: str) -> None:
        """Loads `program` (BCC does so on attach) and attaches it to `target`."""
        try:
            if mode == "kprobe":
                self._bpf.attach_kprobe(event=target.encode(), fn_name=program.encode())
            else:
                self._bpf.attach_raw_tracepoint(tp=target.encode(), fn_name=program.encode())
        except Exception as exc:
            raise BpfError(f"attach {program} ({mode} on {target}): {exc}") from exc
        self.report.points[point] = mode

    def _attach(self, modes: tuple[str, ...]) -> None:
        for mode in modes:
            target = SEND_FUNCTION if mode == "kprobe" else SEND_TRACEPOINT
            try:
                self._attach_one("send", send_program(mode), mode, target)
                break
            except BpfError as exc:
                self.report.rejected[mode] = exc.message
        else:
            reasons = "; ".join(f"{m}: {why}" for m, why in self.report.rejected.items())
            raise BpfError(
                f"the send attach point could not attach with BCC in any mode ({reasons})",
                "run `kvwatch doctor` to see what this kernel offers",
            )
        programs = tracepoint_programs(BCC_TRACEPOINT_MODE)
        for point, (tracepoint, _) in TRACEPOINT_ATTACH_POINTS.items():
            self._attach_one(point, programs[point], BCC_TRACEPOINT_MODE, tracepoint)
        self.report.points["zero_window_probe"] = "unavailable"
        if self.report.send_mode in PROBE0_PROGRAMS:
            try:
                self._attach_one(
                    "zero_window_probe", PROBE0_PROGRAMS["kprobe"], "kprobe", PROBE0_FUNCTION
                )
            except BpfError as exc:
                log.info("zero-window probe attach point not attached: %s", exc.message)

    def program_fds(self) -> dict[str, int]:
        """fd of each attached program, by attach point."""
        names = {"send": send_program(self.report.send_mode)}
        names.update(tracepoint_programs(BCC_TRACEPOINT_MODE))
        if self.report.points.get("zero_window_probe", "unavailable") != "unavailable":
            names["zero_window_probe"] = PROBE0_PROGRAMS["kprobe"]
        return {point: int(self._bpf.funcs[name.encode()].fd) for point, name in names.items()}

    def close(self) -> None:
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def __enter__(self) -> BccPrograms:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
