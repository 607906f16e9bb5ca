"""Per-program run counts and run time from the kernel's BPF statistics.

The kernel counts only while `kernel.bpf_stats_enabled` is 1 (it costs a little per run).
Field offsets of struct bpf_prog_info come from the running kernel's BTF, not from a copy of
the header, so the reader follows the kernel it runs on.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass
from pathlib import Path

from kvwatch.collect.bpf.btf import BtfFile, struct_layout
from kvwatch.collect.bpf.libbpf import check_rc, libbpf

KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


@dataclass(frozen=True)
class ProgramRunStats:
    run_count: int
    run_time_ns: int

    @property
    def average_ns(self) -> float:
        return self.run_time_ns / self.run_count if self.run_count else 0.0


@functools.cache
def _prog_info_layout() -> tuple[int, int, int]:
    with BtfFile(KERNEL_BTF) as btf:
        layout = struct_layout(btf, "bpf_prog_info")
    offsets = dict(layout.members)
    return layout.size, offsets["run_time_ns"], offsets["run_cnt"]


def program_run_stats(program_fd: int) -> ProgramRunStats:
    size, time_offset, count_offset = _prog_info_layout()
    buffer = ctypes.create_string_buffer(size)
    length = ctypes.c_uint32(size)
    check_rc(
        libbpf().bpf_obj_get_info_by_fd(program_fd, buffer, ctypes.byref(length)),
        "read BPF program info",
    )
    (run_time_ns,) = struct.unpack_from("=Q", buffer.raw, time_offset)
    (run_count,) = struct.unpack_from("=Q", buffer.raw, count_offset)
    return ProgramRunStats(run_count=run_count, run_time_ns=run_time_ns)


def set_stats_enabled(enabled: bool) -> bool:
    """Turns the kernel's BPF run statistics on or off; returns the previous setting."""
    previous = STATS_SYSCTL.read_text().strip() == "1"
    STATS_SYSCTL.write_text("1" if enabled else "0")
    return previous
