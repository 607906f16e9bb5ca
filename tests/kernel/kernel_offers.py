"""What the running kernel offers each of kvwatch's attach points, found without kvwatch's own
object.

For every attach point and mode a minimal program (`r0 = 0; exit`) is loaded through the raw
bpf(2) syscall and attached to the same kernel function or tracepoint kvwatch uses. If the
kernel refuses that, the mode is unavailable on this kernel, whatever kvwatch's programs do;
if it accepts it, kvwatch's own programs must load there too, so a refusal of them is a bug
in kvwatch, not a missing kernel feature. x86_64 only (syscall numbers).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from kvwatch.collect.bpf.libbpf import BTF_KIND_TYPEDEF, libbpf, os_error_text
from kvwatch.collect.bpf.loader import SEND_TRACEPOINT, TRACEPOINT_ATTACH_POINTS

SYS_BPF = 321
SYS_PERF_EVENT_OPEN = 298
BPF_PROG_LOAD = 5
BPF_RAW_TRACEPOINT_OPEN = 17
PROG_TYPE_KPROBE = 2
PROG_TYPE_RAW_TRACEPOINT = 17
PROG_TYPE_TRACING = 26
ATTACH_TRACE_RAW_TP = 23
ATTACH_TRACE_FENTRY = 24
ATTACH_TRACE_ITER = 28
# The iterator kvwatch reads its socket-storage table through (kv_dump_sockets).
STORAGE_ITERATOR_TARGET = "bpf_iter_bpf_sk_storage_map"
BTF_KIND_FUNC = 12
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
PERF_FLAG_FD_CLOEXEC = 8
KPROBE_PMU_TYPE = Path("/sys/bus/event_source/devices/kprobe/type")
# mov64 r0, 0; exit
RETURN_ZERO = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])
LICENSE = b"GPL\0"
LOG_BYTES = 4096

# The kernel functions kvwatch's fentry/kprobe programs attach to (bpf/kvwatch.bpf.c).
SEND_FUNCTION = "tcp_sendmsg"
PROBE0_FUNCTION = "tcp_send_probe0"
FUNCTION_MODES = ("fentry", "kprobe")
TRACEPOINT_MODES = ("tp_btf", "raw_tp")
# attach point -> (kernel function or None, tracepoint or None)
POINT_TARGETS: dict[str, tuple[str | None, str | None]] = {
    "send": (SEND_FUNCTION, SEND_TRACEPOINT),
    **{point: (None, tracepoint) for point, (tracepoint, _) in TRACEPOINT_ATTACH_POINTS.items()},
    "zero_window_probe": (PROBE0_FUNCTION, None),
}

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


class ProgLoadAttr(ctypes.Structure):
    """union bpf_attr as BPF_PROG_LOAD reads it, up to attach_prog_fd (stable kernel ABI)."""

    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
        ("prog_btf_fd", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("func_info", ctypes.c_uint64),
        ("func_info_cnt", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64),
        ("line_info_cnt", ctypes.c_uint32),
        ("attach_btf_id", ctypes.c_uint32),
        ("attach_prog_fd", ctypes.c_uint32),
    ]


class RawTracepointAttr(ctypes.Structure):
    """union bpf_attr as BPF_RAW_TRACEPOINT_OPEN reads it; name NULL attaches a BTF program."""

    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32)]


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1), enough for a kprobe."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
    ]


def _check_fd(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os_error_text(code)}")
    return result


def _bpf(command: int, attr: ctypes.Structure, what: str) -> int:
    result = _LIBC.syscall(SYS_BPF, command, ctypes.byref(attr), ctypes.sizeof(attr))
    return _check_fd(int(result), what)


def _load(prog_type: int, attach_type: int = 0, attach_btf_id: int = 0) -> int:
    """Loads `r0 = 0; exit`; a refusal carries the kernel's own log line."""
    insns = ctypes.create_string_buffer(RETURN_ZERO, len(RETURN_ZERO))
    license_text = ctypes.create_string_buffer(LICENSE, len(LICENSE))
    kernel_log = ctypes.create_string_buffer(LOG_BYTES)
    attr = ProgLoadAttr(
        prog_type=prog_type,
        insn_cnt=len(RETURN_ZERO) // 8,
        insns=ctypes.addressof(insns),
        license=ctypes.addressof(license_text),
        log_level=1,
        log_size=LOG_BYTES,
        log_buf=ctypes.addressof(kernel_log),
        expected_attach_type=attach_type,
        attach_btf_id=attach_btf_id,
    )
    try:
        return _bpf(BPF_PROG_LOAD, attr, "load")
    except OSError as exc:
        said = kernel_log.value.decode(errors="replace").strip().splitlines()
        if said:
            raise OSError(exc.errno, f"{exc.strerror} (kernel: {said[-1]})") from exc
        raise


def _open_raw_tracepoint(prog_fd: int, name: str | None) -> int:
    text = ctypes.create_string_buffer(name.encode()) if name else None
    attr = RawTracepointAttr(name=ctypes.addressof(text) if text else 0, prog_fd=prog_fd)
    return _bpf(BPF_RAW_TRACEPOINT_OPEN, attr, "attach")


def _vmlinux_btf_id(name: str, kind: int) -> int:
    lib = libbpf()
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        raise OSError(errno.ENOENT, "the kernel exposes no BTF (/sys/kernel/btf/vmlinux)")
    try:
        found = int(lib.btf__find_by_name_kind(btf, name.encode(), kind))
    finally:
        lib.btf__free(btf)
    if found <= 0:
        raise OSError(errno.ENOENT, f"the kernel's BTF does not describe {name}")
    return found


def _attach_fentry(function: str) -> list[int]:
    btf_id = _vmlinux_btf_id(function, BTF_KIND_FUNC)
    prog = _load(PROG_TYPE_TRACING, ATTACH_TRACE_FENTRY, btf_id)
    return [prog, _open_raw_tracepoint(prog, None)]


def _attach_kprobe(function: str) -> list[int]:
    if not KPROBE_PMU_TYPE.is_file():
        raise OSError(errno.ENOENT, "no kprobe event source (kernel built without CONFIG_KPROBES)")
    prog = _load(PROG_TYPE_KPROBE)
    name = ctypes.create_string_buffer(function.encode())
    attr = PerfEventAttr(
        type=int(KPROBE_PMU_TYPE.read_text()),
        size=ctypes.sizeof(PerfEventAttr),
        config1=ctypes.addressof(name),
    )
    result = _LIBC.syscall(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    event = _check_fd(int(result), f"kprobe on {function}")
    fcntl.ioctl(event, PERF_EVENT_IOC_SET_BPF, prog)
    fcntl.ioctl(event, PERF_EVENT_IOC_ENABLE, 0)
    return [prog, event]


def _attach_tp_btf(tracepoint: str) -> list[int]:
    btf_id = _vmlinux_btf_id(f"btf_trace_{tracepoint}", BTF_KIND_TYPEDEF)
    prog = _load(PROG_TYPE_TRACING, ATTACH_TRACE_RAW_TP, btf_id)
    return [prog, _open_raw_tracepoint(prog, None)]


def _attach_raw_tp(tracepoint: str) -> list[int]:
    prog = _load(PROG_TYPE_RAW_TRACEPOINT)
    return [prog, _open_raw_tracepoint(prog, tracepoint)]


ATTACHERS: dict[str, Callable[[str], list[int]]] = {
    "fentry": _attach_fentry,
    "kprobe": _attach_kprobe,
    "tp_btf": _attach_tp_btf,
    "raw_tp": _attach_raw_tp,
}


def refusal(mode: str, target: str) -> str | None:
    """Why the kernel refuses a minimal `mode` program on `target`, or None if it accepts."""
    opened: list[int] = []
    try:
        opened = ATTACHERS[mode](target)
    except OSError as exc:
        return f"{mode} on {target} refused: {exc.strerror or os_error_text(exc.errno or 0)}"
    finally:
        for fd in reversed(opened):
            os.close(fd)
    return None


def kernel_offers() -> dict[str, dict[str, str | None]]:
    """attach point -> mode -> None (the kernel accepts the mode) or the reason it does not."""
    offers: dict[str, dict[str, str | None]] = {}
    for point, (function, tracepoint) in POINT_TARGETS.items():
        modes: dict[str, str | None] = {}
        if function:
            modes.update({mode: refusal(mode, function) for mode in FUNCTION_MODES})
        if tracepoint:
            modes.update({mode: refusal(mode, tracepoint) for mode in TRACEPOINT_MODES})
        offers[point] = modes
    return offers


def storage_iterator_refusal() -> str | None:
    """Why the kernel refuses a minimal iterator over socket-local storage (what the socket
    storage table is read through), or None if it accepts one: a kernel can load BTF-typed
    programs and still refuse this (seen: EPERM in a VM sandbox), and the loader then keeps
    the records in the LRU hash."""
    try:
        btf_id = _vmlinux_btf_id(STORAGE_ITERATOR_TARGET, BTF_KIND_FUNC)
        os.close(_load(PROG_TYPE_TRACING, ATTACH_TRACE_ITER, btf_id))
    except OSError as exc:
        why = exc.strerror or os_error_text(exc.errno or 0)
        return f"iterator {STORAGE_ITERATOR_TARGET} refused: {why}"
    return None
